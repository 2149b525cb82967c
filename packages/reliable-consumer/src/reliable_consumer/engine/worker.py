"""The worker's lifecycle: start the parts, commit, rebalance, observe, shut down.

Reading top to bottom: ``run`` starts the parts (start-up waits in startup.py), then the
intake (intake.py) loops on ``getmany`` and dispatches batches. A finished batch marks its
offsets done; the commit task commits each partition's contiguous watermark on an
interval or after enough completions. On revoke: stop dispatching, give in-flight
records a bounded time, commit what is done, drop the partition's state (its epoch ends,
so late completions are ignored). On shutdown the same, for everything, then the consumer
leaves the group before anything else is closed; every step is bounded (shutdown.py), and
a stopping worker takes no partition the group hands it.

This module is long because start-up, the commit task, rebalances, the observers and
shutdown share one state (the consumer, each partition's offsets and epoch) and read best
in the order they happen; what each step waits on is in startup.py, intake.py and
shutdown.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, TypeVar

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener
from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaError
from aiokafka.structs import OffsetAndMetadata, TopicPartition

from reliable_consumer.engine.batch.processing import Processor
from reliable_consumer.engine.handlers.breaker import Breakers
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.intake import Intake, RetryPriority
from reliable_consumer.engine.kafka.clients import make_consumer, make_producer
from reliable_consumer.engine.kafka.group_check import GROUP_JOIN_REFUSED, check_session_timeout
from reliable_consumer.engine.kafka.offsets import OffsetTracker
from reliable_consumer.engine.kafka.topic_check import check_topic_access, check_topic_durability
from reliable_consumer.engine.memory_limit import memory_limit_bytes
from reliable_consumer.engine.observation.http import HealthState, HttpServer, make_app
from reliable_consumer.engine.observation.member_report import INTERVAL_S, MemberReporter
from reliable_consumer.engine.observation.membership import MembershipWatch, read_group_progress
from reliable_consumer.engine.observation.metrics import Metrics
from reliable_consumer.engine.outbox.postgres_store import postgres_outbox_store
from reliable_consumer.engine.outbox.producer import relay_producer
from reliable_consumer.engine.outbox.redis_store import RedisOutboxStore
from reliable_consumer.engine.outbox.relay import OutboxRelay
from reliable_consumer.engine.outbox.store import OutboxStore
from reliable_consumer.engine.outbox.topics import check_emitted_topics
from reliable_consumer.engine.postgres.checks import until_checked
from reliable_consumer.engine.postgres.inbox import InboxStore
from reliable_consumer.engine.records import Delivery
from reliable_consumer.engine.redis.client import RedisOps, make_client
from reliable_consumer.engine.redis.delay_queue import QueueGauges, RetryQueue, RetryScheduler
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.redis.layout import check_layout
from reliable_consumer.engine.redis.persistence_check import check_persistence
from reliable_consumer.engine.runtime import collect_when_memory_grows, tune_gc
from reliable_consumer.engine.settings import Settings
from reliable_consumer.engine.shutdown import (
    MIN_STEP_S,
    ExitDeadline,
    ShutdownSteps,
    closing_reserve_s,
)
from reliable_consumer.engine.stalls import Stalls
from reliable_consumer.engine.startup import StoppedWhileStarting, unless_stopped, until_answered

log = logging.getLogger(__name__)
T = TypeVar("T")


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
        self.registry.check_stores(settings.postgres.url is not None)
        self.metrics = metrics or Metrics()
        self.metrics.memory_limit.set(memory_limit_bytes() or 0)
        self.stalls = Stalls(self.metrics)
        # Built here, so breakers that contradict each other fail before anything connects.
        self.breakers = Breakers(
            self.registry, settings.breaker, metrics=self.metrics, stalls=self.stalls
        )
        self.health = HealthState(
            max_poll_gap_s=settings.kafka.max_poll_interval_ms / 2000,
            stalls=self.stalls,
            consuming=consume,
        )
        self.tracker: OffsetTracker[TopicPartition] = OffsetTracker()
        self._stop = asyncio.Event()
        self._commit_now = asyncio.Event()
        self._commit_lock = asyncio.Lock()
        self._completed_since_commit = 0
        self.intake = Intake(settings, self.tracker, self.health, self._stop, self._completed)
        self._background: list[asyncio.Task[Any]] = []
        self._consumer: AIOKafkaConsumer | None = None
        self._producer: AIOKafkaProducer | None = None
        self._http: HttpServer | None = None
        self.scheduler: RetryScheduler | None = None
        self.retry_priority: RetryPriority | None = None  # with the scheduler, when consuming
        self.relay: OutboxRelay | None = None  # when a bound handler emits (engine/outbox/)
        self._relay_task: asyncio.Task[None] | None = None
        self._relay_producer: AIOKafkaProducer | None = None
        self.inbox: InboxStore | None = None  # the postgres effects store, when one is bound
        self.reporter: MemberReporter | None = None
        self.membership: MembershipWatch | None = None  # a consuming worker's, once subscribed
        self.member_report_interval_s = INTERVAL_S  # what `service status` reads (tests: less)
        self._steps: ShutdownSteps | None = None  # set once the shutdown has begun
        self._left_group = False
        self._revoked = asyncio.Event()  # set at every revoke: in-flight waits look again
        self._exit_deadline = ExitDeadline(settings.shutdown_grace_s)

    # --- lifecycle ---

    def request_stop(self) -> None:
        """Begin a graceful shutdown (what SIGTERM and SIGINT do)."""
        self._stop.set()

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT stop the worker, and the process ends by force if the
        shutdown overruns its grace (``shutdown.ExitDeadline``): for the process's entry
        point only, never for a worker run inside another program."""
        loop = asyncio.get_running_loop()

        def stop() -> None:
            self._exit_deadline.arm()
            self.request_stop()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop)

    async def run(self) -> None:
        try:
            try:
                await self._start()
            except StoppedWhileStarting as stopped:
                log.info(
                    f"stop requested while starting ({stopped}); exiting without having started",
                    extra={"waiting_for": str(stopped)},
                )
                return
            if self.settings.tune_gc:
                tune_gc()
                collecting = collect_when_memory_grows(
                    self.metrics.observe_full_collection,
                    growth_bytes=self.settings.gc_collect_growth_mb * 1024 * 1024,
                    ceiling_s=self.settings.gc_collect_max_interval_s,
                )
                self._watch(asyncio.create_task(collecting, name="gc"))
            if self.consume:
                assert self._consumer is not None
                await self.intake.run(self._consumer, self._process)
            else:
                await self._stop.wait()
        finally:
            await self._shutdown()

    async def _start(self) -> None:
        s = self.settings
        if s.http.enabled:
            self._http = HttpServer(
                make_app(self.health, self.metrics),
                s.http.host,
                s.http.port,
                fd=s.http.fd,
                read_timeout_s=s.http.read_timeout_s,
                max_connections=s.http.max_connections,
                threads=s.http.threads,
            )
            self._http.start()
        self.redis = make_client(s.redis)
        self.ops = RedisOps(
            self.redis,
            s.redis,
            on_error=lambda _: self._redis_failed(),
            stalls=self.stalls,
            outage_summary_interval_s=s.outage_summary_interval_s,
        )
        checked = await self._unless_stopped(
            self.ops.call(functools.partial(check_persistence, self.redis, s.redis)),
            "waiting for Redis",
        )
        for warning in checked:
            log.warning(warning)
        await self._unless_stopped(
            self.ops.call(functools.partial(check_layout, self.redis, s.redis)),
            "checking the Redis key layout",
        )
        self.health.redis_ok = True
        self._producer = make_producer(s.kafka)
        await self._unless_stopped(
            until_answered(self._producer.start, self._stop), "waiting for the Kafka producer"
        )
        if self.registry.uses_postgres:
            self.inbox = InboxStore(s.postgres)
            await self.inbox.open()
            checked = await self._unless_stopped(
                until_checked(self.inbox, s.postgres, self._stop, self.stalls),
                "waiting for PostgreSQL",
            )
            for warning in checked:
                log.warning(warning)
        emits = self.registry.emitted_topics
        access = until_answered(lambda: check_topic_access(s, emits), self._stop, self.stalls)
        await self._unless_stopped(access, "checking the worker's access to its topics")
        durability = until_answered(lambda: check_topic_durability(s, emits), self._stop)
        topics = await self._unless_stopped(durability, "checking the Kafka topics")
        for warning in topics.warnings:
            log.warning(warning)
        emitted = until_answered(lambda: check_emitted_topics(s.kafka, self.registry), self._stop)
        await self._unless_stopped(emitted, "checking the topics handlers emit to")
        self.processor = Processor.build(
            s,
            self.registry,
            ops=self.ops,
            producer=self._producer,
            metrics=self.metrics,
            stalls=self.stalls,
            breakers=self.breakers,
            inbox=self.inbox,
            outcomes_max_message_bytes=topics.outcomes_max_message_bytes,
            emitted_max_message_bytes=topics.emitted_max_message_bytes,
        )
        if self.registry.emits:
            await self._start_relay(topics.emitted_max_message_bytes)
        self.intake.held_topics = self.breakers.open_topics
        self.health.circuits = self.breakers.snapshot
        if self.consume:
            session = until_answered(lambda: check_session_timeout(s), self._stop, self.stalls)
            await self._unless_stopped(session, "checking the group's session timeout")
            self._consumer = make_consumer(s.kafka)
            await self._unless_stopped(
                until_answered(self._consumer.start, self._stop), "waiting for the Kafka consumer"
            )
            self._consumer.subscribe(self.registry.topics, listener=_Rebalance(self))
            self._watch(asyncio.create_task(self._commit_loop(), name="commits"))
            consumer = self._consumer
            self.membership = MembershipWatch(
                self.stalls,
                session_timeout_s=s.kafka.session_timeout_ms / 1000,
                read_progress=lambda: read_group_progress(s.kafka, consumer, self.registry.topics),
            )
            self.health.unassigned_s = self.membership.unassigned_for
            self._watch(asyncio.create_task(self.membership.run(self._stop), name="membership"))
        self.health.kafka_ok = True
        self._watch(asyncio.create_task(self._observe_loop(), name="observe"))
        self._watch(asyncio.create_task(self._heartbeat_loop(), name="heartbeat"))
        self.reporter = MemberReporter(
            self.redis,
            s.redis.effective_prefix,
            client_id=s.kafka.client_id,
            tracker=self.tracker,
            consumer=lambda: self._consumer,
            in_flight=lambda: self.intake.in_flight,
            circuits=self.breakers.snapshot,
            stalls=lambda: {c: stall.detail for c, stall in self.stalls.active().items()},
            consuming=self.consume,
            interval_s=self.member_report_interval_s,
        )
        # Not watched: a report that cannot be written must not fail /healthz.
        self._background.append(asyncio.create_task(self.reporter.run(), name="member-report"))
        if s.run_retry_scheduler or not self.consume:
            self.scheduler = RetryScheduler(
                RetryQueue(self.ops, RedisKeys(s.redis.effective_prefix)),
                lambda batch, give_up: self.processor.process_reliably(
                    batch, give_up=give_up, ordered=False
                ),
                s.retry,
                max_in_flight=max(1, s.max_in_flight // 4),
                on_gauges=self._set_retry_gauges,
                on_lateness=self._retry_priority(s) if self.consume else None,
                on_next_due=self.processor.parts.lane.expect
                if self.consume and s.retry.priority_after_ms and s.retry.priority_holds_fetched
                else None,
            )
            if self.retry_priority is not None:
                self.retry_priority.running_late = self.scheduler.running_late_ms
            self._watch(asyncio.create_task(self.scheduler.run(), name="retries"))
        self.health.mark_started()
        log.info(
            "worker started",
            extra={"topics": self.registry.topics, "group": s.kafka.group_id},
        )

    def outbox_stores(self) -> list[OutboxStore]:
        """The outboxes the relay publishes from: one per effects store in use."""
        stores: list[OutboxStore] = [
            RedisOutboxStore(self.redis, RedisKeys(self.settings.redis.effective_prefix))
        ]
        postgres = postgres_outbox_store(self.inbox, self.settings.postgres)
        if postgres is not None:  # a bound handler keeps its effects in PostgreSQL
            stores.append(postgres)
        return stores

    async def _start_relay(self, max_message_bytes: Mapping[str, int]) -> None:
        """Publish what handlers emit: every worker runs the relay, one per store publishes."""
        s = self.settings
        producer = await self._unless_stopped(
            until_answered(lambda: relay_producer(s.kafka, s.outbox.idempotence), self._stop),
            "waiting for the broker to answer whether it grants producer ids",
        )
        self._relay_producer = producer
        await self._unless_stopped(
            until_answered(producer.start, self._stop),
            "waiting for the outbox relay's Kafka producer",
        )
        self.relay = OutboxRelay(
            self.outbox_stores(),
            redis=self.redis,
            keys=RedisKeys(s.redis.effective_prefix),
            producer=producer,
            settings=s.outbox,
            metrics=self.metrics,
            stalls=self.stalls,
            max_message_bytes=max_message_bytes,
        )
        self.processor.on_emitted(self.relay.wake)
        self._relay_task = asyncio.create_task(self.relay.run(self._stop), name="outbox-relay")
        self._watch(self._relay_task)

    def _unless_stopped(self, step: Awaitable[T], waiting_for: str) -> Awaitable[T]:
        return unless_stopped(step, self._stop, waiting_for)

    def _process(self, deliveries: list[Delivery], give_up: Callable[[], bool]) -> Awaitable[bool]:
        return self.processor.process_reliably(deliveries, give_up=give_up)

    def _completed(self, count: int) -> None:
        """Records done: commit early once enough have completed since the last commit."""
        self._completed_since_commit += count
        if self._completed_since_commit >= self.settings.commit_every_records:
            self._commit_now.set()

    # --- commits ---

    async def _commit_loop(self) -> None:
        interval = self.settings.commit_interval_ms / 1000
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._commit_now.wait(), interval)
            self._commit_now.clear()
            await self.commit()

    async def commit(self, tps: Iterable[TopicPartition] | None = None) -> None:
        """Commit the contiguous done-watermark of the given (default: all) partitions.

        Bounded by the session timeout: aiokafka retries a commit for as long as it finds
        no coordinator, and a commit that never ends would hold the lock every revoke
        needs, and with it the whole group's rebalance.
        """
        if self._consumer is None or self._left_group:
            return
        async with self._commit_lock:
            offsets = self.tracker.committable(tps)
            if not offsets:
                return
            self._completed_since_commit = 0
            try:
                async with asyncio.timeout(self.settings.kafka.session_timeout_ms / 1000):
                    await self._consumer.commit(
                        {tp: OffsetAndMetadata(off, "") for tp, (off, _) in offsets.items()}
                    )
            except (CommitFailedError, IllegalStateError, KafkaError, TimeoutError) as exc:
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
        # A rebalance began: this member is out of the group until it is assigned again.
        self.health.joined_group = False
        if self.membership is not None:
            self.membership.rebalancing()
        revoked &= set(self.tracker.partitions())
        if not revoked:
            return
        self.intake.revoking |= revoked
        if self.retry_priority is not None:  # the held waves of the revoked partitions go on
            self.retry_priority.interrupt("rebalance")
        running = self.intake.running(revoked)
        if running:
            grace = self.settings.revoke_grace_s
            if self._steps is not None:  # stopping: the shutdown's deadline bounds it too
                grace = min(grace, self._steps.left())
            _, abandoned = await asyncio.wait(running, timeout=grace)
            if abandoned:
                log.warning(
                    "revoke grace over; abandoning in-flight records to the next owner",
                    extra={"count": len(abandoned)},
                )
        await self.commit(revoked)
        for tp in revoked:
            self.tracker.revoke(tp)  # ends the epoch: late completions are ignored
            self.metrics.forget_partition(tp.topic, tp.partition)
        self.intake.forget(revoked)
        self._revoked.set()
        self.health.assigned_partitions = len(self.tracker.partitions())
        if self.membership is not None:
            self.membership.holding(self.health.assigned_partitions)
        if self.reporter is not None:
            self.reporter.poke()
        log.info("partitions revoked", extra={"partitions": _names(revoked)})

    async def _on_assigned(self, assigned: set[TopicPartition]) -> None:
        if self._stop.is_set():
            # A stopping worker would never process them: they are not taken, and the
            # shutdown leaves the group (as soon as what it holds is committed), which
            # hands them to a member that will.
            if assigned:
                log.warning(
                    "partitions assigned while stopping: not taken; leaving the group",
                    extra={"partitions": _names(assigned)},
                )
            return
        for tp in assigned:
            if self.tracker.epoch(tp) is None:
                self.tracker.assign(tp)
        self.health.joined_group = True
        self.stalls.clear(GROUP_JOIN_REFUSED)  # the group took us in
        self.health.assigned_partitions = len(self.tracker.partitions())
        if self.membership is not None:
            self.membership.joined(self.health.assigned_partitions)
        if self.reporter is not None:
            self.reporter.poke()
        log.info("partitions assigned", extra={"partitions": _names(assigned)})

    # --- observation ---

    def _redis_failed(self) -> None:
        self.health.redis_ok = False
        self.metrics.redis_errors.inc()

    def _retry_priority(self, s: Settings) -> Callable[[int], None]:
        """Late retries go before fresh fetches (intake.RetryPriority); returns its input."""
        priority = self.retry_priority = RetryPriority(
            s.retry.priority_after_ms,
            s.retry.priority_max_pause_ms,
            on_change=self._retry_priority_changed,
        )
        self.intake.retries_first = priority.active
        if s.retry.priority_holds_fetched:  # and what was fetched waits too (batch/lane.py)
            self.processor.parts.lane.follow(priority.active)
            lane = self.processor.parts.lane
            lane.on_turn_ended = self.metrics.retry_turn_held.inc
            after_ms = s.retry.turn_after_ms
            lane.turn_after_s = after_ms / 1000 if after_ms else None
        return priority.observe

    def _retry_priority_changed(self, active: bool, why: str, paused_s: float) -> None:
        self.metrics.retry_priority_active.set(1 if active else 0)
        if not active:
            self.processor.parts.lane.episode_ended()
        if not active:  # one line per episode, when it ends (the gauge shows it meanwhile)
            self.metrics.retry_priority_paused.inc(paused_s)
            log.info(
                "fresh fetches were held back for late retries",
                extra={"paused_s": round(paused_s, 3), "ended": why},
            )

    def _set_retry_gauges(self, gauges: QueueGauges) -> None:
        self.metrics.retry_depth.labels("due").set(gauges.due)
        self.metrics.retry_depth.labels("inflight").set(gauges.inflight)
        self.metrics.retry_depth.labels("waiting").set(gauges.waiting)  # behind their chain
        self.metrics.set_retry_breakdown(gauges.breakdown)
        self.metrics.retry_oldest_due_age.set(gauges.oldest_due_age_s)

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
            self.metrics.in_flight.set(self.intake.in_flight)
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
        """Finish, commit, leave the group, then close: all within ``shutdown_grace_s``.

        In-flight records get the grace less a reserve for the steps after them; what they
        finish is committed, and the consumer leaves the group at once, so its partitions
        move before anything else is closed (the retry scheduler, the handler runners and
        the producer need no partition). Every step is bounded by what is left of the one
        deadline and logged (``ShutdownSteps``); records abandoned past the grace are
        redelivered to the next owner and absorbed by the idempotency markers.
        """
        self.health.stopping = True
        self._stop.set()
        grace = self.settings.shutdown_grace_s
        steps = self._steps = ShutdownSteps(grace)
        if self.scheduler is not None:
            self.scheduler.stop()  # its running batches finish alongside the intake's
        if self.retry_priority is not None:  # the held fresh waves finish too
            self.retry_priority.interrupt("stopping", last=True)
        finished = await steps.run(
            "in-flight records",
            self._in_flight_settled(),
            within_s=steps.left(reserve_s=closing_reserve_s(grace)),
        )
        abandoned = set() if finished else self.intake.running()
        if not finished:
            # Past the grace, calls stop retrying underneath too: a batch then ends at
            # its next failed call even if its cancellation is lost on the way (see
            # until_done.cancellation_swallowed).
            self._stop_retrying()
            for task in abandoned:
                task.cancel()
            log.warning(
                "shutdown grace over; in-flight records left to redelivery",
                extra={"count": len(abandoned)},
            )
        await steps.run("final commit", self.commit())
        if self._consumer is not None:
            await steps.run("leaving the group", self._consumer.stop(), floor_s=1.0)
            self._left_group = True  # nothing can be committed any more
        # From here a failing Redis or Kafka call ends its batch instead of retrying: the
        # retries' items stay leased in Redis (the reaper re-queues them), the records are
        # redelivered to the partitions' next owner.
        self._stop_retrying()
        if abandoned:
            await steps.run("abandoned records", asyncio.wait(abandoned))
        if self.scheduler is not None:
            await steps.run("retry scheduler", self.scheduler.drain(timeout_s=steps.left()))
        if hasattr(self, "processor"):
            await steps.run("handler runners", self.processor.aclose())
        if self._relay_task is not None:
            # It ends its round (publish, ack, mark) and gives its leases up; one cut short
            # is published again by the next holder (at least once, same event ids).
            await steps.run("outbox relay", asyncio.wait({self._relay_task}))
        for task in self._background:
            task.cancel()
        if self._background:
            await steps.run("background loops", asyncio.wait(self._background))
        if self._producer is not None:
            await steps.run("producer flush", self._producer.stop())  # what is buffered
        if self._relay_producer is not None:
            await steps.run("outbox producer", self._relay_producer.stop())
        if self.inbox is not None:
            await steps.run("PostgreSQL close", self.inbox.close())
        if hasattr(self, "redis"):
            await steps.run("Redis close", self.redis.aclose())
        if self._http is not None:
            self._http.stop(timeout_s=max(steps.left(), MIN_STEP_S))
        # The exit deadline stays armed: the event loop still cancels and awaits the tasks
        # left (an abandoned step among them) as it closes.
        log.info("worker stopped", extra={"took_s": round(steps.elapsed(), 3)})

    async def _in_flight_settled(self) -> None:
        """Until no batch of a partition this worker still holds is running.

        A revoke meanwhile (the group rebalanced) ends the wait for its partitions: their
        offsets can no longer be committed by this member.
        """
        while running := self.intake.running():
            self._revoked.clear()
            revoke = asyncio.ensure_future(self._revoked.wait())
            try:
                await asyncio.wait({*running, revoke}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                revoke.cancel()

    def _stop_retrying(self) -> None:
        """Make Redis and Kafka calls give up after their current try instead of retrying."""
        if hasattr(self, "ops"):
            self.ops.stopping = True
        if hasattr(self, "processor"):
            self.processor.stop_retrying()


def _names(tps: Iterable[TopicPartition]) -> list[str]:
    return sorted(f"{tp.topic}[{tp.partition}]" for tp in tps)
