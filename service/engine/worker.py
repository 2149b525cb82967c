"""The consumer loop: fetch, dispatch, pause/resume, rebalance, commit.

Reading top to bottom: ``run`` starts the parts, then loops on ``getmany``. Each
fetched record is tracked in ``OffsetTracker``; a partition's records go to a task
per batch, which waits for an earlier batch of the partition only when their Kafka
keys overlap (per-key order). A finished batch marks its offsets done; the commit
task commits each partition's contiguous watermark on an interval or after enough
completions. When in-flight limits are reached the loop waits for room, pauses
partitions only when starved, and keeps polling, so the group never evicts us for a
missed poll. On revoke: stop dispatching, give in-flight records a bounded
time, commit what is done, drop the partition's state (its epoch ends, so late
completions are ignored). On shutdown the same, for everything.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener
from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaError
from aiokafka.structs import ConsumerRecord, OffsetAndMetadata, TopicPartition
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    wait_random_exponential,
)

from service.engine.kafka_client import make_consumer, make_producer
from service.engine.keys import RedisKeys
from service.engine.metrics import Metrics
from service.engine.observability import HealthState, HttpServer
from service.engine.offsets import OffsetTracker
from service.engine.processing import Processor
from service.engine.records import Delivery, clean_headers
from service.engine.redis_client import RedisOps, make_client
from service.engine.registry import Registry
from service.engine.retries import RetryQueue, RetryScheduler
from service.engine.runtime import tune_gc
from service.engine.settings import Settings
from service.engine.stalls import Stalls
from service.engine.topic_check import check_topic_durability

log = logging.getLogger(__name__)
T = TypeVar("T")

POLL_TIMEOUT_MS = 200
PAUSED_POLL_TIMEOUT_MS = 20
CAPACITY_WAIT_S = 1.0


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, worker: Worker) -> None:
        self._worker = worker

    async def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        await self._worker._on_revoked(set(revoked))

    async def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        await self._worker._on_assigned(set(assigned))


class Worker:
    def __init__(
        self,
        settings: Settings,
        registry: Registry | None = None,
        *,
        metrics: Metrics | None = None,
        consume: bool = True,
    ) -> None:
        """``consume=False`` runs only the retry scheduler (``service retry-scheduler``)."""
        self.settings = settings
        self.consume = consume
        self.registry = registry or Registry.from_settings(settings.topics)
        self.metrics = metrics or Metrics()
        self.stalls = Stalls(self.metrics)
        self.health = HealthState(
            max_poll_gap_s=settings.kafka.max_poll_interval_ms / 2000,
            stalls=self.stalls,
            consuming=consume,
        )
        self.tracker: OffsetTracker[TopicPartition] = OffsetTracker()
        self._stop = asyncio.Event()
        self._commit_now = asyncio.Event()
        self._capacity_freed = asyncio.Event()
        self._commit_lock = asyncio.Lock()
        self._tasks: dict[TopicPartition, set[asyncio.Task[None]]] = {}
        # Per partition, the running batches and the Kafka keys each holds (for ordering).
        self._batches: dict[TopicPartition, list[tuple[asyncio.Task[None], frozenset[bytes]]]] = {}
        self._revoking: set[TopicPartition] = set()
        self._paused: set[TopicPartition] = set()
        self._in_flight = 0
        # Bytes of those records (key + value + headers), bounded by max_in_flight_bytes, and
        # the largest record of the last fetch: how many more may be asked for.
        self._in_flight_bytes = 0
        self._size_hint = settings.kafka.max_partition_fetch_bytes
        self._starved = False  # no room freed up during a whole capacity wait
        self._completed_since_commit = 0
        self._background: list[asyncio.Task[Any]] = []
        self._consumer: AIOKafkaConsumer | None = None
        self._producer: AIOKafkaProducer | None = None
        self._http: HttpServer | None = None
        self.scheduler: RetryScheduler | None = None

    # --- lifecycle ---

    def request_stop(self) -> None:
        """Begin a graceful shutdown (what SIGTERM and SIGINT do)."""
        self._stop.set()

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)

    async def run(self) -> None:
        try:
            try:
                await self._start()
            except _StoppedWhileStarting as stopped:
                log.info(
                    f"stop requested while starting ({stopped}); exiting without having started",
                    extra={"waiting_for": str(stopped)},
                )
                return
            if self.settings.tune_gc:
                tune_gc()
            if self.consume:
                await self._poll_loop()
            else:
                await self._stop.wait()
        finally:
            await self._shutdown()

    async def _start(self) -> None:
        s = self.settings
        if s.http.enabled:
            self._http = HttpServer(
                self.health,
                self.metrics,
                s.http.host,
                s.http.port,
                read_timeout_s=s.http.read_timeout_s,
                max_connections=s.http.max_connections,
                threads=s.http.threads,
            )
            self._http.start()
        self.redis = make_client(s.redis)
        self.ops = RedisOps(
            self.redis, s.redis, on_error=lambda _: self._redis_failed(), stalls=self.stalls
        )
        checked = await self._unless_stopped(
            self.ops.call(self.ops.check_persistence), "waiting for Redis"
        )
        for warning in checked:
            log.warning(warning)
        self.health.redis_ok = True
        self._producer = make_producer(s.kafka)
        await self._unless_stopped(
            _until_answered(self._producer.start, self._stop), "waiting for the Kafka producer"
        )
        durability = _until_answered(lambda: check_topic_durability(s), self._stop)
        for warning in await self._unless_stopped(durability, "checking the Kafka topics"):
            log.warning(warning)
        self.processor = Processor.build(
            s,
            self.registry,
            ops=self.ops,
            producer=self._producer,
            metrics=self.metrics,
            stalls=self.stalls,
        )
        if self.consume:
            self._consumer = make_consumer(s.kafka)
            await self._unless_stopped(
                _until_answered(self._consumer.start, self._stop), "waiting for the Kafka consumer"
            )
            self._consumer.subscribe(self.registry.topics, listener=_Rebalance(self))
            self._watch(asyncio.create_task(self._commit_loop(), name="commits"))
        self.health.kafka_ok = True
        self._watch(asyncio.create_task(self._observe_loop(), name="observe"))
        self._watch(asyncio.create_task(self._heartbeat_loop(), name="heartbeat"))
        if s.run_retry_scheduler or not self.consume:
            self.scheduler = RetryScheduler(
                RetryQueue(self.ops, RedisKeys(s.redis.key_prefix)),
                lambda batch, give_up: self.processor.process_reliably(
                    batch, give_up=give_up, ordered=False
                ),
                s.retry,
                max_in_flight=max(1, s.max_in_flight // 4),
                on_depth=self._set_retry_depth,
            )
            self._watch(asyncio.create_task(self.scheduler.run(), name="retries"))
        self.health.mark_started()
        log.info(
            "worker started",
            extra={"topics": self.registry.topics, "group": s.kafka.group_id},
        )

    async def _unless_stopped(self, step: Awaitable[T], waiting_for: str) -> T:
        """``await step``, unless a stop is requested first: then it is cancelled.

        Start-up steps retry until Redis or Kafka answers, which may be never; the retry
        loops underneath only stop at shutdown, so SIGTERM must end the wait from here.
        """
        task = asyncio.ensure_future(step)
        stopping = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            abandoned = not task.done()
            if abandoned:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if abandoned:
            raise _StoppedWhileStarting(waiting_for)
        return task.result()

    async def _poll_loop(self) -> None:
        assert self._consumer is not None
        consumer = self._consumer
        stopping = asyncio.ensure_future(self._stop.wait())
        try:
            await self._poll(consumer, stopping)
        finally:
            stopping.cancel()

    async def _poll(self, consumer: AIOKafkaConsumer, stopping: asyncio.Future[Any]) -> None:
        while not self._stop.is_set():
            capacity = self._room()
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
                capacity = self._room()
                if capacity <= 0:
                    self._apply_backpressure()  # paused before the fetch: nothing more comes
            timeout = PAUSED_POLL_TIMEOUT_MS if self._paused else POLL_TIMEOUT_MS
            fetch = asyncio.ensure_future(
                consumer.getmany(timeout_ms=timeout, max_records=max(1, capacity))
            )
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
                self.health.kafka_ok = False
                log.warning("fetch failed", extra={"error": repr(exc)})
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), 1.0)
                continue
            self.health.kafka_ok = True
            self.health.last_poll = self.health.clock()
            if batches:
                self._size_hint = max(_size(r) for records in batches.values() for r in records)
            for tp, records in batches.items():
                epoch = self.tracker.epoch(tp)
                if epoch is None or tp in self._revoking:
                    continue  # fetched before a revoke: the next owner reads it again
                fresh = self.tracker.fetched_many(tp, epoch, records)
                size = self.settings.max_batch_records
                for i in range(0, len(fresh), size):
                    self._dispatch(tp, epoch, fresh[i : i + size])
            self._apply_backpressure()

    def _room(self) -> int:
        """How many more records may be fetched: under the count and the byte budget.

        By bytes, as many records as fit if each is as large as the largest of the last
        fetch; none while that would cross the budget, unless nothing is in flight (so a
        record larger than the whole budget still goes through, alone).
        """
        room = self.settings.max_in_flight - self._in_flight
        free = self.settings.max_in_flight_bytes - self._in_flight_bytes
        if self._in_flight_bytes and free < self._size_hint:
            return 0
        return min(room, max(1, free // max(self._size_hint, 1)))

    # --- dispatch ---

    def _dispatch(
        self, tp: TopicPartition, epoch: int, records: list[ConsumerRecord[Any, Any]]
    ) -> None:
        """Start one batch; it waits for earlier batches of the partition it must follow.

        Headers in the worker's reserved namespace are dropped here, before anything reads
        or copies them (a producer must not set a dead letter's reason or a redrive mark).
        """
        inject = self.settings.fault_injection
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
        ordering = self.settings.ordering
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
        self._tasks.setdefault(tp, set()).add(task)
        self._in_flight += len(deliveries)
        self._in_flight_bytes += nbytes

    async def _handle(
        self,
        tp: TopicPartition,
        epoch: int,
        deliveries: list[Delivery],
        before: list[asyncio.Task[None]],
        nbytes: int,
    ) -> None:
        def give_up() -> bool:  # shutdown, or the partition moved on to another owner
            return self._stop.is_set() or self.tracker.epoch(tp) != epoch

        try:
            if before:
                await asyncio.wait(before)
            finished = await self.processor.process_reliably(deliveries, give_up=give_up)
            if not finished:  # left uncommitted: the next owner or run redelivers them
                return
            if not self.tracker.done_many(tp, epoch, [d.offset for d in deliveries]):
                return  # the partition was revoked meanwhile: nothing to count
            self._completed_since_commit += len(deliveries)
            if self._completed_since_commit >= self.settings.commit_every_records:
                self._commit_now.set()
        finally:
            self._in_flight -= len(deliveries)
            self._in_flight_bytes -= nbytes
            self._capacity_freed.set()
            tasks = self._tasks.get(tp)
            if tasks is not None:
                tasks.discard(asyncio.current_task())

    def _apply_backpressure(self) -> None:
        """Pause what is over its limit, resume what is under; polling never stops."""
        assert self._consumer is not None
        assigned = set(self._consumer.assignment()) - self._revoking
        if self._starved and self._room() <= 0:
            want = assigned  # full for a whole wait: pause everything, keep polling
        else:
            limit = self.settings.max_in_flight_per_partition
            want = {tp for tp in assigned if self.tracker.in_flight(tp) >= limit}
        if pause := want - self._paused:
            self._consumer.pause(*pause)
        if resume := (self._paused - want) & assigned:
            self._consumer.resume(*resume)
        self._paused = want

    # --- commits ---

    async def _commit_loop(self) -> None:
        interval = self.settings.commit_interval_ms / 1000
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._commit_now.wait(), interval)
            self._commit_now.clear()
            await self.commit()

    async def commit(self, tps: Iterable[TopicPartition] | None = None) -> None:
        """Commit the contiguous done-watermark of the given (default: all) partitions."""
        if self._consumer is None:
            return
        async with self._commit_lock:
            offsets = self.tracker.committable(tps)
            if not offsets:
                return
            self._completed_since_commit = 0
            try:
                await self._consumer.commit(
                    {tp: OffsetAndMetadata(off, "") for tp, (off, _) in offsets.items()}
                )
            except (CommitFailedError, IllegalStateError, KafkaError) as exc:
                # A rebalance took the partitions (or the broker hiccuped): the next owner
                # starts from the last successful commit, and idempotency absorbs repeats.
                self.metrics.commit_failures.inc()
                log.warning("offset commit failed", extra={"error": repr(exc)})
                return
            for tp, (off, epoch) in offsets.items():
                self.tracker.committed(tp, epoch, off)
                self.metrics.committed_offset.labels(tp.topic, str(tp.partition)).set(off)

    # --- rebalance ---

    async def _on_revoked(self, revoked: set[TopicPartition]) -> None:
        revoked &= set(self.tracker.partitions())
        if not revoked:
            return
        self._revoking |= revoked
        running = {t for tp in revoked for t in self._tasks.get(tp, ())}
        if running:
            _, abandoned = await asyncio.wait(running, timeout=self.settings.revoke_grace_s)
            if abandoned:
                log.warning(
                    "revoke grace over; abandoning in-flight records to the next owner",
                    extra={"count": len(abandoned)},
                )
        await self.commit(revoked)
        for tp in revoked:
            self.tracker.revoke(tp)  # ends the epoch: late completions are ignored
            self._batches.pop(tp, None)
            self._tasks.pop(tp, None)
            self.metrics.forget_partition(tp.topic, tp.partition)
        self._paused -= revoked
        self._revoking -= revoked
        self.health.assigned_partitions = len(self.tracker.partitions())
        log.info("partitions revoked", extra={"partitions": _names(revoked)})

    async def _on_assigned(self, assigned: set[TopicPartition]) -> None:
        for tp in assigned:
            if self.tracker.epoch(tp) is None:
                self.tracker.assign(tp)
        self.health.joined_group = True
        self.health.assigned_partitions = len(self.tracker.partitions())
        log.info("partitions assigned", extra={"partitions": _names(assigned)})

    # --- observation ---

    def _redis_failed(self) -> None:
        self.health.redis_ok = False
        self.metrics.redis_errors.inc()

    def _set_retry_depth(self, due: int, inflight: int) -> None:
        self.metrics.retry_depth.labels("due").set(due)
        self.metrics.retry_depth.labels("inflight").set(inflight)

    def _watch(self, task: asyncio.Task[Any]) -> None:
        """Keep a background loop; one that dies while not stopping makes /healthz fail."""
        self._background.append(task)

        def ended(t: asyncio.Task[Any]) -> None:
            if t.cancelled() or self._stop.is_set():
                return
            error = t.exception()
            self.health.crashed[t.get_name()] = repr(error) if error else "returned"
            log.error(
                "background loop ended while running; /healthz fails so the process restarts",
                exc_info=error,
                extra={"loop": t.get_name()},
            )

        task.add_done_callback(ended)

    async def _heartbeat_loop(self) -> None:
        """Tick while the event loop turns: liveness of every process, scheduler-only too."""
        interval = min(1.0, self.health.max_poll_gap_s / 4)
        while not self._stop.is_set():
            self.health.heartbeat = self.health.clock()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), interval)

    async def _observe_loop(self) -> None:
        """Refresh partition gauges and dependency health every few seconds."""
        while not self._stop.is_set():
            if self._consumer is not None:
                await self._observe_partitions(self._consumer)
            self.metrics.in_flight.set(self._in_flight)
            try:
                await asyncio.wait_for(self.redis.ping(), 2.0)
                self.health.redis_ok = True
            except Exception:
                self.health.redis_ok = False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), 5.0)

    async def _observe_partitions(self, consumer: AIOKafkaConsumer) -> None:
        for tp in list(consumer.assignment()):
            labels = (tp.topic, str(tp.partition))
            high = consumer.highwater(tp)
            progress = self.tracker.progress(tp)
            with contextlib.suppress(KafkaError, IllegalStateError, AssertionError):
                self.metrics.position.labels(*labels).set(await consumer.position(tp))
            if high is not None:
                self.metrics.high_watermark.labels(*labels).set(high)
                if progress is not None and progress.committed is not None:
                    self.metrics.lag.labels(*labels).set(max(0, high - progress.committed))

    # --- shutdown ---

    async def _shutdown(self) -> None:
        self.health.stopping = True
        self._stop.set()
        grace = self.settings.shutdown_grace_s
        if self.scheduler is not None:
            self.scheduler.stop()
        running = {t for tasks in self._tasks.values() for t in tasks}
        if running:
            _, pending = await asyncio.wait(running, timeout=grace)
            if pending:
                # Past the grace, calls stop retrying underneath too: a batch then ends at
                # its next failed call even if its cancellation is lost on the way (see
                # retrying.cancellation_swallowed).
                self._stop_retrying()
            for task in pending:
                task.cancel()
            if pending:
                log.warning(
                    "shutdown grace over; in-flight records left to redelivery",
                    extra={"count": len(pending)},
                )
                await asyncio.wait(pending)
        if self.scheduler is not None:
            await self.scheduler.drain(timeout_s=min(grace, 5.0))
        await self.commit()  # the final synchronous commit
        if hasattr(self, "processor"):
            await self.processor.aclose()
        for task in self._background:
            task.cancel()
        for task in self._background:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._stop_retrying()
        if self._producer is not None:
            with contextlib.suppress(Exception):
                await self._producer.stop()  # flushes what is buffered
        if self._consumer is not None:
            with contextlib.suppress(Exception):
                await self._consumer.stop()  # leaves the group
        if hasattr(self, "redis"):
            await self.redis.aclose()
        if self._http is not None:
            self._http.stop()
        log.info("worker stopped")

    def _stop_retrying(self) -> None:
        """Make Redis and Kafka calls give up after their current try instead of retrying."""
        if hasattr(self, "ops"):
            self.ops.stopping = True
        if hasattr(self, "processor"):
            self.processor.stop_retrying()


class _StoppedWhileStarting(Exception):
    """A stop was requested before the worker had started; the text says what it awaited."""


def _size(r: ConsumerRecord[Any, Any]) -> int:
    """A record's bytes as the in-flight budget counts them: key, value and headers."""
    size = len(r.key or b"") + len(r.value or b"")
    if r.headers:
        size += sum(len(k) + len(v or b"") for k, v in r.headers)
    return size


def _names(tps: Iterable[TopicPartition]) -> list[str]:
    return sorted(f"{tp.topic}[{tp.partition}]" for tp in tps)


def _log_kafka_wait(state: RetryCallState) -> None:
    """One warning per failed start-up attempt: a silent wait looks like a hang."""
    error = state.outcome.exception() if state.outcome else None
    log.warning(
        "waiting for Kafka at start, retrying",
        extra={"attempt": state.attempt_number, "error": repr(error)},
    )


async def _until_answered(call: Callable[[], Awaitable[T]], stop: asyncio.Event) -> T:
    """``call()`` (a client's start, a metadata read) with backoff until the broker answers
    or a stop is requested."""
    async for attempt in AsyncRetrying(
        retry=retry_if_exception_type((KafkaError, OSError)),
        wait=wait_random_exponential(multiplier=0.2, max=5.0),
        stop=lambda _: stop.is_set(),
        before_sleep=_log_kafka_wait,
        reraise=True,
    ):
        with attempt:
            return await call()
    raise AssertionError("unreachable: tenacity either returns or raises")
