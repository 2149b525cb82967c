"""A batch of records on its path: decode -> claim -> handle -> done | retry | dead letter.

``Processor.process_batch`` takes the records of one fetched batch (or a batch of due
retries) and returns only once every record's fate is durable: effects and
done-marker written, parked in the delay queue, or acknowledged by the dead-letter
topic; and, when outcomes are on, its outcome event acknowledged. Only then may the
offsets count as done.

Each record follows the same decisions one at a time would take, but every stage
talks to Redis or Kafka once for the whole batch: one claim script, one finish
script, one park script, one outcome batch. That is where the worker's speed comes
from (see bench/). Records that share a Kafka key run in successive waves, so a key's
records are handled in offset order.

This module dispatches: the stages in order, and the handlers themselves (sync inline,
async on the runner pool, their leases stretched as they start). What each stage decides
and writes is in decisions.py. Failures of the infrastructure (Redis or Kafka not
answering) are not the record's fault: they are retried below this layer, and the batch
simply stays in flight meanwhile.

This module is long because it is the one place that orders the stages and runs every kind
of handler (sync, async, postgres) with its timeout and leases; what the stages decide is
already out, in decisions.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from typing import Any

from aiokafka import AIOKafkaProducer
from redis.asyncio import Redis

from reliable_consumer.engine.batch.decisions import Decisions
from reliable_consumer.engine.batch.gate import Gate, GaveUp
from reliable_consumer.engine.batch.jobs import Fate, Job, key_waves, log_fields
from reliable_consumer.engine.batch.postgres_wave import PostgresWaves
from reliable_consumer.engine.handlers import faults
from reliable_consumer.engine.handlers.breaker import Breakers
from reliable_consumer.engine.handlers.context import Context, Effects
from reliable_consumer.engine.handlers.policies import BreakerPolicy
from reliable_consumer.engine.handlers.pool import HandlerPool, Slot
from reliable_consumer.engine.handlers.redaction import describe_error
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.handlers.stuck_calls import CallAbandoned, StuckCalls, fence
from reliable_consumer.engine.kafka.clients import make_producer
from reliable_consumer.engine.kafka.publisher import Publisher, document_bytes_for
from reliable_consumer.engine.observation.metrics import Metrics
from reliable_consumer.engine.postgres.checks import until_checked
from reliable_consumer.engine.postgres.inbox import InboxStore
from reliable_consumer.engine.records import Delivery, Outcome
from reliable_consumer.engine.redis.client import RedisOps, make_client
from reliable_consumer.engine.redis.delay_queue import RetryQueue
from reliable_consumer.engine.redis.idempotency import ExtendRequest, ExtendStatus, Idempotency
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.redis.persistence_check import check_persistence
from reliable_consumer.engine.settings import Settings
from reliable_consumer.engine.stalls import Stalls
from reliable_consumer.engine.until_done import until_done

log = logging.getLogger(__name__)

# A record whose processing fails unexpectedly this often is dead-lettered as "internal";
# the waits between its tries grow from the first to the longest (until_done's backoff).
INTERNAL_ATTEMPTS = 5
INTERNAL_FIRST_WAIT_S = 1.0
INTERNAL_BACKOFF_MAX_S = 30.0
# A lease stretched as a handler starts outlives its timeout and cancel grace by this much:
# the watchdog's tick, a loaded event loop, and the finish or park that follows the handler.
LEASE_MARGIN_MS = 1_000
POSTGRES_EFFECTS_REFUSAL = (
    "this handler keeps its effects in PostgreSQL (store='postgres'): write them with SQL on "
    "ctx.db, in the transaction that also records the inbox row; ctx.effects takes nothing"
)


class Processor:
    """A batch of records through its stages; the decisions themselves are ``decisions``."""

    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        idempotency: Idempotency,
        retries: RetryQueue,
        publisher: Publisher,
        redis: Redis,
        metrics: Metrics,
        breakers: Breakers | None = None,
        inbox: InboxStore | None = None,
        stalls: Stalls | None = None,
    ) -> None:
        self._settings = settings
        self._registry = registry
        self._idem = idempotency
        self._publisher = publisher
        self._redis = redis
        self._metrics = metrics
        self.decisions = Decisions(settings, registry, idempotency, retries, publisher, metrics)
        # Handler calls given up on because they ignored their cancellation (stuck_calls.py).
        self.stuck = StuckCalls(metrics, stalls)
        # Async handlers running at once, across all batches: protects what they call.
        self._pool = HandlerPool(
            settings.max_concurrent_handlers,
            cancel_grace_s=settings.handler_cancel_grace_s,
            stuck=self.stuck,
        )
        self._latency: dict[str, Any] = {}  # handler name -> its histogram child
        self._key_prefix = settings.redis.key_prefix
        # The circuit breakers in front of the handlers (none: every record is admitted).
        self.breakers = breakers or Breakers(registry, BreakerPolicy(enabled=False))
        self._gate = Gate(self.breakers, idempotency, settings.retry.busy_delay_ms)
        # The postgres effects store's waves (None: no bound handler keeps effects there).
        self._sql: PostgresWaves | None = None
        if inbox is not None:
            self._sql = PostgresWaves(
                inbox,
                self.decisions,
                self.breakers,
                context_of=self._context,
                timeout_of=self._timeout_of,
                renew_leases=self._renew_leases,
                observe=lambda name, s: self._latency_of(name).observe(s),
                fault_injection=settings.fault_injection,
                metrics=metrics,
                stalls=stalls,
                cancel_grace_s=settings.handler_cancel_grace_s,
                stuck=self.stuck,
            )

    @classmethod
    def build(
        cls,
        settings: Settings,
        registry: Registry,
        *,
        ops: RedisOps,
        producer: AIOKafkaProducer,
        metrics: Metrics,
        stalls: Stalls | None = None,
        breakers: Breakers | None = None,
        inbox: InboxStore | None = None,
        outcomes_max_message_bytes: int | None = None,
    ) -> Processor:
        """The record path over an open Redis client and a started producer.

        ``stalls`` hears of what holds progress back outside the records (the worker's,
        so readiness and ``worker_stalled`` see it), e.g. a dead-letter topic that is missing.
        ``outcomes_max_message_bytes``: the outcomes topic's limit, when the start-up check
        read it; outcome documents are cut to fit it.
        """
        keys = RedisKeys(settings.redis.key_prefix)
        idempotency = Idempotency(
            ops, keys, ttl_s=settings.idempotency.ttl_s, lease_ms=settings.idempotency.lease_ms
        )
        publisher = Publisher(
            producer,
            dead_letter_topic=settings.dead_letter_topic,
            outcomes_topic=settings.outcomes_topic(),
            stalls=stalls,
            outcome_layout=settings.outcomes.layout,
            outage_summary_interval_s=settings.outage_summary_interval_s,
            max_document_bytes=document_bytes_for(outcomes_max_message_bytes),
        )
        retries = RetryQueue(ops, keys)
        if breakers is None:
            breakers = Breakers(registry, settings.breaker, metrics=metrics, stalls=stalls)
        return cls(
            settings,
            registry,
            idempotency,
            retries,
            publisher,
            ops.client,
            metrics,
            breakers,
            inbox,
            stalls,
        )

    async def process(self, delivery: Delivery) -> Outcome:
        """One record on its own (tools and tests); the worker calls process_batch."""
        return (await self.process_batch([delivery]))[0]

    async def process_reliably(
        self,
        deliveries: Sequence[Delivery],
        *,
        give_up: Callable[[], bool],
        ordered: bool = True,
    ) -> bool:
        """``process_batch``, made to finish even when something unexpected breaks.

        An exception escaping ``process_batch`` is not the records' failure (that is
        decided inside) but ours: a bug, or a dependency past its retries. Abandoning the
        batch would stall its partition's watermark, so the records are retried one at a
        time, in order, with backoff; one that keeps failing is dead-lettered with reason
        ``internal``. Returns False only when ``give_up`` says to stop (shutdown, revoke).
        """
        try:
            await self.process_batch(deliveries, ordered=ordered, give_up=give_up)
            return True
        except GaveUp:  # stopped while its handler's circuit was open: left uncommitted
            return False
        except Exception:
            log.exception("batch failed; retrying its records one by one")
        for d in deliveries:
            if not await self._isolate(d, give_up, ordered):
                return False
        return True

    async def _isolate(self, d: Delivery, give_up: Callable[[], bool], ordered: bool) -> bool:
        """One record of a broken batch, retried on its own until it has a fate.

        The same retry loop as every Redis and Kafka call (``until_done.until_done``): here
        every failure is transient, the ``INTERNAL_ATTEMPTS``-th and later ones end in an
        ``internal`` dead letter if that can be written. False when ``give_up`` says so.
        """
        failures = 0

        async def attempt() -> None:
            nonlocal failures
            if give_up():
                raise GaveUp
            try:
                await self.process_batch([d], ordered=ordered, give_up=give_up)
            except GaveUp:
                raise
            except Exception as exc:
                failures += 1
                log.exception("record failed unexpectedly", extra=log_fields(Job(d)))
                if failures < INTERNAL_ATTEMPTS or not await self._dead_letter_internal(d, exc):
                    raise

        try:
            await until_done(
                attempt,
                transient=lambda exc: not isinstance(exc, GaveUp),
                stopping=give_up,
                on_failure=lambda _exc, _attempt: None,  # logged above, with the record
                first_wait_s=INTERNAL_FIRST_WAIT_S,
                max_wait_s=INTERNAL_BACKOFF_MAX_S,
            )
        except Exception:  # GaveUp, or the last failure when give_up() turned true
            return False
        return True

    async def _dead_letter_internal(self, d: Delivery, exc: BaseException) -> bool:
        job = Job(delivery=d, handler=self._registry.for_topic(d.topic))
        job.dead_letter("internal", describe_error(exc))
        try:
            await self.decisions.dead_letter([job])
            await self.decisions.emit([job])
        except Exception:
            log.exception("could not dead-letter the record either; will retry")
            return False
        return True

    async def process_batch(
        self,
        deliveries: Sequence[Delivery],
        *,
        ordered: bool = True,
        give_up: Callable[[], bool] | None = None,
    ) -> list[Outcome]:
        """Every record of the batch to a durable fate (see the module's docstring).

        A record whose handler's circuit is open waits here, in memory, until the breaker
        lets it run (its offset stays uncommitted); ``give_up`` ends that wait (raising
        ``GaveUp``) on shutdown or when the partition is revoked.
        """
        deliveries = await self.decisions.vet_redrives(deliveries)
        jobs = [self.decisions.prepare(d) for d in deliveries]
        live = [j for j in jobs if j.fate is None]
        ordering = self._settings.ordering if ordered else "none"
        if ordering == "partition":
            waves = [[job] for job in live]  # strictly one after another, in offset order
        elif ordering == "key" or (ordered and any(j.chain for j in live)):
            waves = key_waves(live)
        else:
            waves = [live]
        # Chains a record of this batch will park in: its key's later records wait behind it
        # (they park after it, in offset order, in the same PARK call).
        parking: set[str] = set()
        for wave in waves:
            if parking:
                for job in wave:
                    if job.chain in parking:
                        job.park_behind()
            pending = wave
            while pending:
                admitted, pending = await self._gate.admit(pending, give_up)
                await self.decisions.claim(admitted)
                live = [j for j in admitted if j.fate is None]
                sql = [j for j in live if j.handler and j.handler.store == "postgres"]
                if sql:
                    live = [j for j in live if j.handler and j.handler.store != "postgres"]
                await self._handle(live)
                if sql:  # one transaction, committed before FINISH marks the keys done
                    await self._postgres(sql)
                await self.decisions.claim_failed(admitted)
                await self.decisions.finish(admitted)
                pending += await self._gate.held(admitted)
            parking.update(j.chain for j in wave if j.chain and j.fate is Fate.PARK)
        await self.decisions.park([j for j in jobs if j.fate is Fate.PARK])
        await self.decisions.dead_letter([j for j in jobs if j.fate is Fate.DEAD_LETTER])
        await self.decisions.emit(jobs)
        return [j.outcome or Outcome.DEAD_LETTERED for j in jobs]

    # --- stage 3: run the handlers (sync inline, async as bounded tasks) ---

    async def _handle(self, jobs: list[Job]) -> None:
        inject = self._settings.fault_injection
        later: list[tuple[Job, Context, bool]] = []
        inline = Counter[str]()  # handler name -> inline runs
        # Inline successes not yet told to their breaker, by handler and whether they were
        # first attempts: told once per batch, or before a failure of the same handler is
        # (the breaker sees the runs in the same order).
        untold = Counter[tuple[str, bool]]()
        started = time.perf_counter()
        for job in jobs:
            ctx = self._context(job)
            handler, payload = job.handler, job.payload
            assert handler is not None and payload is not None
            try:
                hang = inject and faults.inject(ctx)
                if hang or handler.is_async:
                    later.append((job, ctx, hang))
                    continue
                inline[handler.name] += 1
                job.ran = True
                handler.run_sync(payload, ctx)
                untold[handler.name, job.delivery.attempt == 1] += 1
            except Exception as exc:
                job.ran = True
                breaker = self.breakers.for_handler(handler.name)
                if breaker is not None:
                    for first in (True, False):
                        if successes := untold.pop((handler.name, first), 0):
                            breaker.record_success(successes, first_attempt=first)
                self.decisions.handler_failed(job, exc, breaker=breaker)
        for (name, first), successes in untold.items():
            if successes and (breaker := self.breakers.for_handler(name)):
                breaker.record_success(successes, first_attempt=first)
        if inline:
            # Inline handlers take microseconds: one observation of the batch's mean per
            # handler keeps the histogram honest about them without a per-record cost.
            mean = (time.perf_counter() - started) / inline.total()
            for name in inline:
                self._latency_of(name).observe(mean)
        if later:
            timeouts = [self._timeout_of(job) for job, _, _ in later]
            run = self._run_async
            await self._pool.run(
                [
                    functools.partial(run, job, ctx, hang, timeout)
                    for (job, ctx, hang), timeout in zip(later, timeouts, strict=True)
                ],
                shortest_timeout_s=min(timeouts),
            )

    async def _postgres(self, jobs: list[Job]) -> None:
        if self._sql is None:
            from reliable_consumer.engine.errors import ConfigurationError

            raise ConfigurationError(
                f"handler {jobs[0].name!r} keeps its effects in PostgreSQL but the worker has "
                "no PostgreSQL store (set WORKER_POSTGRES__URL)"
            )
        await self._sql.run(jobs)

    def _timeout_of(self, job: Job) -> float:
        assert job.handler is not None
        return job.handler.timeout_s or self._settings.handler_timeout_s

    async def _run_async(
        self, job: Job, ctx: Context, hang: bool, limit_s: float, slot: Slot
    ) -> None:
        """One async handler on a pool runner, under its timeout; records its own failure."""
        assert job.handler is not None and job.payload is not None
        if (job.holds_claim or job.delivery.is_retry) and not await self._renew_leases(
            job, limit_s
        ):
            return
        started = time.perf_counter()
        breaker = self.breakers.for_handler(job.handler.name)
        job.ran = True
        abandon = functools.partial(self._abandoned, job, ctx, limit_s, started)
        try:
            with slot.deadline(limit_s, job.handler.name, abandon):
                if hang:
                    log.warning(faults.HANG_STARTED, extra=log_fields(job))
                    await asyncio.Event().wait()
                # Handler.__call__, inlined on the hot path.
                result = job.handler.func(job.payload, ctx)
                if result is not None:
                    await result
            if breaker is not None:
                breaker.record_success(first_attempt=job.delivery.attempt == 1)
        except TimeoutError as exc:
            self.decisions.handler_failed(
                job, exc, f"handler timed out after {limit_s:g} s", breaker=breaker
            )
        except Exception as exc:
            self.decisions.handler_failed(job, exc, breaker=breaker)
        finally:
            if not slot.abandoned:  # else measured when it was abandoned
                self._latency_of(job.name).observe(time.perf_counter() - started)

    def _abandoned(self, job: Job, ctx: Context, limit_s: float, started: float) -> None:
        """The pool gave up on this record's call: its fate now, as for a timeout; the call
        is fenced, since it still runs and may still queue effects."""
        fence(ctx)
        self._latency_of(job.name).observe(time.perf_counter() - started)
        error = CallAbandoned(limit_s, self._settings.handler_cancel_grace_s)
        log.warning(
            "handler ignored its cancellation past the grace; its record goes on without it",
            extra={**log_fields(job), "error": str(error)},
        )
        breaker = self.breakers.for_handler(job.name)
        self.decisions.handler_failed(job, error, str(error), breaker=breaker)

    async def _renew_leases(self, job: Job, limit_s: float) -> bool:
        """Make the claim and retry lease outlast the handler about to start, or park.

        Both were taken when the wave was claimed, but the record may have waited for a
        runner since, while its timeout only starts now: without this a lease could end
        mid-run and another delivery of the key run beside it. A fresh claim with time to
        spare costs nothing; otherwise one script stretches both, only while still ours.
        Returns False (the record parked, same attempt) when one was already lost.
        """
        # Until its fate is decided: the timeout, and the cancel grace a stuck call gets.
        need_ms = math.ceil((limit_s + self._settings.handler_cancel_grace_s) * 1000)
        need_ms += LEASE_MARGIN_MS
        retry_lease = job.delivery.retry_lease
        if retry_lease is None and job.claim_until - time.monotonic() >= need_ms / 1000:
            return True
        sent = time.monotonic()
        claim_ms = max(self._settings.idempotency.lease_ms, need_ms)
        request = ExtendRequest(
            key=job.idem_key if job.holds_claim else "",
            token=job.token,
            claim_ms=claim_ms,
            retry_id=job.delivery.retry_id if retry_lease is not None else "",
            retry_lease=retry_lease,
            retry_ms=max(self._settings.retry.lease_ms, need_ms),
        )
        ((status, lease),) = await self._idem.extend_many([request])
        if status is ExtendStatus.OK:
            job.claim_until = sent + claim_ms / 1000
            if lease is not None:  # the new fencing token: PARK must present this one
                job.delivery = replace(job.delivery, retry_lease=lease)
            return True
        busy_ms = self._settings.retry.busy_delay_ms
        if status is ExtendStatus.LOST_CLAIM:
            job.holds_claim = False
            why = "busy: claim lease expired before the handler started"
        else:  # PARK will find the lease lost too, and release our claim
            why = "superseded: retry lease expired before the handler started"
        job.park(job.delivery.attempt, why, busy_ms)
        return False

    def stop_retrying(self) -> None:
        """Kafka writes give up after their current try (shutdown, past its grace)."""
        self._publisher.stopping = True

    async def aclose(self) -> None:
        """Stop the handler runners (after the batches using them have ended)."""
        await self._pool.aclose()
        if self.stuck:
            # asyncio cancels them once more at exit and waits for them: said, not hidden.
            log.error(
                "%d abandoned handler call(s) still run at shutdown: the process exits once "
                "they end, or when it is killed",
                len(self.stuck),
            )

    def _context(self, job: Job) -> Context:
        d = job.delivery
        assert job.handler is not None
        # Scoped: the handler's effects may write only under its own namespaces.
        effects = job.effects = Effects([], self._key_prefix, job.handler.namespaces)
        if job.handler.store == "postgres":
            effects.refusal = POSTGRES_EFFECTS_REFUSAL
        return Context(  # positional: this runs once per record
            d.topic,
            d.partition,
            d.offset,
            d.key,
            d.headers,
            d.timestamp_ms,
            d.attempt,
            job.dedupe_key or "",
            effects,
            self._redis,
            self._key_prefix,
        )

    def _latency_of(self, name: str) -> Any:
        child = self._latency.get(name)
        if child is None:
            child = self._latency[name] = self._metrics.handler_seconds.labels(name)
        return child


@contextlib.asynccontextmanager
async def open_processor(
    settings: Settings,
    registry: Registry,
    metrics: Metrics | None = None,
    stalls: Stalls | None = None,
) -> AsyncIterator[Processor]:
    """A Processor with its own Redis client and producer, for work outside the worker.

    Replays (``service pipeline replay``) and tools use it to put records through exactly
    the worker's path: same claims, same effects, same dead letters and outcome events.
    """
    client = make_client(settings.redis)
    ops = RedisOps(
        client,
        settings.redis,
        stalls=stalls,
        outage_summary_interval_s=settings.outage_summary_interval_s,
    )
    producer = make_producer(settings.kafka)
    processor: Processor | None = None
    inbox: InboxStore | None = None
    try:
        for warning in await ops.call(functools.partial(check_persistence, client, settings.redis)):
            log.warning(warning)
        if registry.uses_postgres:
            inbox = InboxStore(settings.postgres)
            await inbox.open()
            for warning in await until_checked(inbox, settings.postgres, asyncio.Event(), stalls):
                log.warning(warning)
        await producer.start()
        processor = Processor.build(
            settings,
            registry,
            ops=ops,
            producer=producer,
            metrics=metrics or Metrics(),
            stalls=stalls,
            inbox=inbox,
        )
        yield processor
    finally:
        ops.stopping = True
        if processor is not None:
            await processor.aclose()
        if inbox is not None:
            await inbox.close()
        await producer.stop()
        await client.aclose()
