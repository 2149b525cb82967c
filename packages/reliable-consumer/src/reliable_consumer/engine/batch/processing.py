"""A batch of records on its path: decode -> claim -> handle -> done | retry | dead letter.

``Processor.process_batch`` takes the records of one fetched batch (or a batch of due
retries) and returns only once every record's fate is durable: effects and
done-marker written, parked in the delay queue, or acknowledged by the dead-letter
topic; and, when outcomes are on, its outcome event acknowledged. Only then may the
offsets count as done.

Each record follows the same decisions one at a time would take, but every stage
talks to Redis or Kafka once for the whole batch: one claim script, one finish
script, one park script, one outcome batch. That is where the worker's speed comes
from (see bench/). The finish script and the outcome batch are shared further, with the
other batches that reach them at the same moment (the partitions of one fetch:
``Idempotency.finish_many``, ``Publisher.outcomes``). Records that share a Kafka key run
in successive waves, so a key's records are handled in offset order.

This module dispatches: the stages in order, the Redis path's handlers to the runner
(runner.py: sync inline, async on the runner pool, their leases stretched as they start)
and the postgres handlers to their waves (postgres_wave.py, on the same runner). What each
stage decides and writes is in decisions.py. Failures of the infrastructure (Redis or Kafka
not answering) are not the record's fault: they are retried below this layer, and the batch
simply stays in flight meanwhile. The parts every stage shares are built once, here
(parts.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from aiokafka import AIOKafkaProducer
from redis.asyncio import Redis

from reliable_consumer.engine.batch import traces
from reliable_consumer.engine.batch.decisions import Decisions
from reliable_consumer.engine.batch.gate import Gate, GaveUp
from reliable_consumer.engine.batch.jobs import Fate, Job, key_waves, log_fields
from reliable_consumer.engine.batch.lane import CHECK_EVERY
from reliable_consumer.engine.batch.leases import LeaseKeeper
from reliable_consumer.engine.batch.parts import Parts
from reliable_consumer.engine.batch.postgres_wave import PostgresWaves
from reliable_consumer.engine.batch.runner import HandlerRunner
from reliable_consumer.engine.handlers.breaker import Breakers
from reliable_consumer.engine.handlers.policies import BreakerPolicy
from reliable_consumer.engine.handlers.redaction import describe_error
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.handlers.stuck_calls import StuckCalls
from reliable_consumer.engine.kafka.clients import make_producer
from reliable_consumer.engine.kafka.publisher import Publisher, document_bytes_for
from reliable_consumer.engine.observation.metrics import Metrics
from reliable_consumer.engine.observation.tracing import RecordTracer, record_tracer
from reliable_consumer.engine.postgres.checks import until_checked
from reliable_consumer.engine.postgres.inbox import InboxStore
from reliable_consumer.engine.records import Delivery, Outcome
from reliable_consumer.engine.redis.client import RedisOps, make_client
from reliable_consumer.engine.redis.delay_queue import RetryQueue
from reliable_consumer.engine.redis.idempotency import Idempotency
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.redis.persistence_check import check_persistence
from reliable_consumer.engine.schemas.registry_client import RegistryClient
from reliable_consumer.engine.schemas.writer_schemas import WaitAbandoned, WriterSchemas
from reliable_consumer.engine.settings import Settings
from reliable_consumer.engine.stalls import Stalls
from reliable_consumer.engine.until_done import until_done

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

log = logging.getLogger(__name__)

# A record whose processing fails unexpectedly this often is dead-lettered as "internal";
# the waits between its tries grow from the first to the longest (until_done's backoff).
INTERNAL_ATTEMPTS = 5
INTERNAL_FIRST_WAIT_S = 1.0
INTERNAL_BACKOFF_MAX_S = 30.0


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
        tracer_provider: TracerProvider | None = None,
        schemas: WriterSchemas | None = None,
        emitted_limits: Mapping[str, int] | None = None,
    ) -> None:
        if schemas is None and registry.uses_schema_registry:
            schemas = writer_schemas(settings, metrics, stalls)
        self.parts = Parts(
            settings,
            registry,
            idempotency,
            retries,
            publisher,
            redis,
            metrics,
            # The circuit breakers in front of the handlers (none: every record is admitted).
            breakers=breakers or Breakers(registry, BreakerPolicy(enabled=False)),
            stuck=StuckCalls(metrics, stalls),
            stalls=stalls,
            keys=RedisKeys(settings.redis.effective_prefix),
            schemas=schemas,
            emitted_limits=dict(emitted_limits or {}),
        )
        self._settings = settings
        self.decisions = Decisions(self.parts)
        self.breakers = self.parts.breakers
        self.stuck = self.parts.stuck
        self._runner = HandlerRunner(self.parts, self.decisions)
        self._gate = Gate(self.breakers, idempotency, settings.retry.busy_delay_ms)
        # The postgres effects store's waves (None: no bound handler keeps effects there).
        self._sql: PostgresWaves | None = None
        if inbox is not None:
            self._sql = PostgresWaves(inbox, self.parts, self.decisions, self._runner)
        # A span per record when tracing is on (observation/tracing.py); None costs nothing.
        self.tracer: RecordTracer | None = record_tracer(settings.kafka.group_id, tracer_provider)

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
        emitted_max_message_bytes: Mapping[str, int] | None = None,
        tracer_provider: TracerProvider | None = None,
    ) -> Processor:
        """The record path over an open Redis client and a started producer.

        ``stalls`` hears of what holds progress back outside the records (the worker's,
        so readiness and ``worker_stalled`` see it), e.g. a dead-letter topic that is missing.
        ``outcomes_max_message_bytes``: the outcomes topic's limit, when the start-up check
        read it; outcome documents are cut to fit it. ``emitted_max_message_bytes``: each
        emitted topic's; an emitted record that cannot fit is refused. ``tracer_provider``:
        where the record spans go (tests); by default the process's, when tracing is on.
        """
        keys = RedisKeys(settings.redis.effective_prefix)
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
            tracer_provider,
            emitted_limits=emitted_max_message_bytes,
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
        job = Job(delivery=d, handler=self.parts.registry.for_topic(d.topic))
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
        try:
            await self.decisions.fetch_writer_schemas(deliveries, give_up or _never)
        except WaitAbandoned:
            raise GaveUp from None  # left uncommitted, like a record held at an open circuit
        jobs = await self._prepare(deliveries)
        if self.tracer is None:
            await self._decide(jobs, ordered, give_up)
        else:
            with traces.traced(self.tracer, jobs):  # a span per record, ended with the batch
                await self._decide(jobs, ordered, give_up)
        return [j.outcome or Outcome.DEAD_LETTERED for j in jobs]

    async def _prepare(self, deliveries: Sequence[Delivery]) -> list[Job]:
        """Every record decoded and vetted; a fresh batch lets a retry falling due go first
        every ``CHECK_EVERY`` records (lane.py), as it does between its handler calls."""
        prepare = self.decisions.prepare
        if len(deliveries) <= CHECK_EVERY or deliveries[0].is_retry:
            return [prepare(d) for d in deliveries]
        lane = self.parts.lane
        jobs: list[Job] = []
        for start in range(0, len(deliveries), CHECK_EVERY):
            if start:
                await lane.checkpoint()
            jobs.extend(prepare(d) for d in deliveries[start : start + CHECK_EVERY])
        return jobs

    async def _decide(
        self, jobs: list[Job], ordered: bool, give_up: Callable[[], bool] | None
    ) -> None:
        """The batch's stages, every record to a durable fate."""
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
        # Later waves wait for earlier ones, and parked records for the last: their leases
        # are kept alive meanwhile (leases.py).
        keeper = None
        if len(waves) > 1:
            keeper = LeaseKeeper(self.parts.idempotency, self._settings, jobs)
        try:
            for wave in waves:
                if keeper is not None:
                    await keeper.hand_over(wave)
                await self._wave(wave, parking, give_up)
        finally:
            if keeper is not None:
                await keeper.stop()
        if self.tracer is not None:
            traces.decided(jobs)
        await self.decisions.park([j for j in jobs if j.fate is Fate.PARK])
        await self.decisions.dead_letter([j for j in jobs if j.fate is Fate.DEAD_LETTER])
        await self.decisions.emit(jobs)

    async def _wave(
        self, wave: list[Job], parking: set[str], give_up: Callable[[], bool] | None
    ) -> None:
        """One wave to its fate (FINISH for the succeeded; the parked wait for the batch)."""
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
            await self._runner.run(live)
            if sql:  # one transaction, committed before FINISH marks the keys done
                await self._postgres(sql)
            await self.decisions.claim_failed(admitted)
            await self.decisions.finish(admitted)
            if self.tracer is not None:
                traces.held(admitted)
            pending += await self._gate.held(admitted)
        parking.update(j.chain for j in wave if j.chain and j.fate is Fate.PARK)

    async def _postgres(self, jobs: list[Job]) -> None:
        if self._sql is None:
            from reliable_consumer.engine.errors import ConfigurationError

            raise ConfigurationError(
                f"handler {jobs[0].name!r} keeps its effects in PostgreSQL but the worker has "
                "no PostgreSQL store (set WORKER_POSTGRES__URL)"
            )
        await self._sql.run(jobs)

    def on_emitted(self, wake: Callable[[], None]) -> None:
        """Call ``wake`` whenever FINISH appended emitted records to the Redis outbox."""
        self.parts.idempotency.on_emitted = wake

    def stop_retrying(self) -> None:
        """Kafka writes and schema look-ups give up after their current try (shutdown, past
        its grace)."""
        self.parts.publisher.stopping = True
        if self.parts.schemas is not None:
            self.parts.schemas.stopping = True

    async def aclose(self) -> None:
        """Stop the handler runners (after the batches using them have ended)."""
        await self._runner.aclose()
        if self.parts.schemas is not None:
            await self.parts.schemas.aclose()
        if self.stuck:
            # asyncio cancels them once more at exit and waits for them: said, not hidden.
            log.error(
                "%d abandoned handler call(s) still run at shutdown: the process exits once "
                "they end, or when it is killed",
                len(self.stuck),
            )


def _never() -> bool:
    return False


def writer_schemas(settings: Settings, metrics: Metrics, stalls: Stalls | None) -> WriterSchemas:
    """The cache of writers' schemas over a client of the configured registry."""
    config = settings.schema_registry
    if config.url is None:
        from reliable_consumer.engine.errors import ConfigurationError

        raise ConfigurationError(
            "a bound handler reads schema-registry values (value_format=RegistryAvro): "
            "set WORKER_SCHEMA_REGISTRY__URL"
        )
    client = RegistryClient(
        config.url,
        timeout_s=config.timeout_s,
        metrics=metrics,
        username=config.username,
        password=config.password.get_secret_value() if config.password else None,
    )
    return WriterSchemas(
        client,
        stalls=stalls,
        unknown_ttl_s=config.unknown_id_ttl_s,
        outage_summary_interval_s=settings.outage_summary_interval_s,
    )


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
