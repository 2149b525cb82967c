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

Failures of the record (bad payload, handler errors) are decided here. Failures of
the infrastructure (Redis or Kafka not answering) are not the record's fault: they
are retried below this layer, and the batch simply stays in flight meanwhile.
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
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

from aiokafka import AIOKafkaProducer
from pydantic import BaseModel, ValidationError
from redis.asyncio import Redis

from service.engine import faults
from service.engine.context import Context, Effects
from service.engine.handler_pool import HandlerPool, Slot
from service.engine.idempotency import (
    ClaimRequest,
    ClaimStatus,
    DeadRequest,
    ExtendRequest,
    ExtendStatus,
    FinishRequest,
    FinishStatus,
    Idempotency,
    RedriveTicket,
    fingerprint,
)
from service.engine.kafka_client import make_producer
from service.engine.keys import RedisKeys
from service.engine.metrics import Metrics
from service.engine.publisher import Publisher, encode_outcome
from service.engine.records import REDRIVE_HEADER as REDRIVE_HEADER  # where redrive finds it
from service.engine.records import (
    Delivery,
    Outcome,
    redrive_of,
    redrive_ticket_value,
    without_redrive,
)
from service.engine.redaction import describe_error, record_text
from service.engine.redis_client import RedisOps, make_client
from service.engine.registry import Handler, Registry
from service.engine.retries import ParkRequest, ParkStatus, RetryQueue, backoff_ms, now_ms
from service.engine.settings import Settings
from service.engine.stalls import Stalls

log = logging.getLogger(__name__)

# A record whose processing fails unexpectedly this often is dead-lettered as "internal".
INTERNAL_ATTEMPTS = 5
INTERNAL_BACKOFF_MAX_S = 30.0
# A lease stretched as a handler starts outlives its timeout by this much: the watchdog's
# tick, a loaded event loop, and the finish or park that follows the handler.
LEASE_MARGIN_MS = 1_000


@dataclass(slots=True, frozen=True)
class DecodeFailure:
    reason: str  # malformed | too_large | tombstone
    detail: str


def decode(handler: Handler[Any], delivery: Delivery, max_bytes: int) -> BaseModel | DecodeFailure:
    """Validate the raw value into the handler's model; never echoes the payload back."""
    value = delivery.value
    if value is None:
        return DecodeFailure("tombstone", "record value is null")
    if len(value) > max_bytes:
        return DecodeFailure("too_large", f"value is {len(value)} bytes, limit {max_bytes}")
    try:
        # The model's validator itself: what model_validate_json calls, minus its wrapper.
        payload: BaseModel = handler.model.__pydantic_validator__.validate_json(value)
    except ValidationError as exc:
        return DecodeFailure("malformed", describe_validation_error(exc))
    return payload


def describe_validation_error(exc: ValidationError, limit: int = 5) -> str:
    parts = []
    for err in exc.errors(include_input=False, include_url=False)[:limit]:
        where = ".".join(str(p) for p in err["loc"]) or "value"
        parts.append(f"{where}: {err['msg']}")
    more = exc.error_count() - limit
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


class _Fate(Enum):
    """Where a record is heading, decided stage by stage, made durable at the end."""

    SUCCEEDED = "succeeded"
    DUPLICATE = "duplicate"
    PARK = "park"
    DEAD_LETTER = "dead_letter"


@dataclass(slots=True)
class _Job:
    """One record's state through the stages of its batch."""

    delivery: Delivery
    handler: Handler[Any] | None = None
    payload: BaseModel | None = None
    dedupe_key: str | None = None
    idem_key: str = ""
    token: str = ""
    fingerprint: str = ""
    optimistic: bool = False  # an effects-only handler's delivery: no claim, checked at finish
    holds_claim: bool = False
    claim_until: float = 0.0  # monotonic time the claim surely lasts to (from its send time)
    effects: Effects | None = None
    fate: _Fate | None = None
    reason: str | None = None  # dead-letter reason, retry error, or duplicate kind
    detail: str = ""  # dead-letter error text
    next_attempt: int = 0
    delay_ms: int = 0
    outcome: Outcome | None = None

    @property
    def name(self) -> str:
        return self.handler.name if self.handler else ""

    def dead_letter(self, reason: str, detail: str) -> None:
        self.fate, self.reason, self.detail = _Fate.DEAD_LETTER, reason, detail

    def park(self, attempt: int, error: str, delay_ms: int) -> None:
        self.fate, self.reason = _Fate.PARK, error
        self.next_attempt, self.delay_ms = attempt, delay_ms


class Processor:
    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        idempotency: Idempotency,
        retries: RetryQueue,
        publisher: Publisher,
        redis: Redis,
        metrics: Metrics,
    ) -> None:
        self._settings = settings
        self._registry = registry
        self._idem = idempotency
        self._retries = retries
        self._publisher = publisher
        self._redis = redis
        self._metrics = metrics
        # Async handlers running at once, across all batches: protects what they call.
        self._pool = HandlerPool(settings.max_concurrent_handlers)
        self._latency: dict[str, Any] = {}  # handler name -> its histogram child
        self._key_prefix = settings.redis.key_prefix

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
    ) -> Processor:
        """The record path over an open Redis client and a started producer.

        ``stalls`` hears of what holds progress back outside the records (the worker's,
        so readiness and ``worker_stalled`` see it), e.g. a dead-letter topic that is missing.
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
        )
        retries = RetryQueue(ops, keys)
        return cls(settings, registry, idempotency, retries, publisher, ops.client, metrics)

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
            await self.process_batch(deliveries, ordered=ordered)
            return True
        except Exception:
            log.exception("batch failed; retrying its records one by one")
        for d in deliveries:
            failures = 0
            while True:
                if give_up():
                    return False
                try:
                    await self.process_batch([d], ordered=ordered)
                    break
                except Exception as exc:
                    failures += 1
                    log.exception("record failed unexpectedly", extra=_log_fields(_Job(d)))
                    if failures >= INTERNAL_ATTEMPTS and await self._dead_letter_internal(d, exc):
                        break
                    await asyncio.sleep(min(INTERNAL_BACKOFF_MAX_S, 0.25 * 2**failures))
        return True

    async def _dead_letter_internal(self, d: Delivery, exc: BaseException) -> bool:
        job = _Job(delivery=d, handler=self._registry.for_topic(d.topic))
        job.dead_letter("internal", describe_error(exc))
        try:
            await self._dead_letter([job])
            await self._emit([job])
        except Exception:
            log.exception("could not dead-letter the record either; will retry")
            return False
        return True

    async def process_batch(
        self, deliveries: Sequence[Delivery], *, ordered: bool = True
    ) -> list[Outcome]:
        deliveries = await self._vet_redrives(deliveries)
        jobs = [self._prepare(d) for d in deliveries]
        live = [j for j in jobs if j.fate is None]
        ordering = self._settings.ordering if ordered else "none"
        if ordering == "partition":
            waves = [[job] for job in live]  # strictly one after another, in offset order
        elif ordering == "key":
            waves = _waves(live)
        else:
            waves = [live]
        for wave in waves:
            await self._claim(wave)
            await self._handle([j for j in wave if j.fate is None])
            await self._claim_failed(wave)
            await self._finish(wave)
        await self._park([j for j in jobs if j.fate is _Fate.PARK])
        await self._dead_letter([j for j in jobs if j.fate is _Fate.DEAD_LETTER])
        await self._emit(jobs)
        return [j.outcome or Outcome.DEAD_LETTERED for j in jobs]

    # --- stage 0: a redrive is one only with its ticket (one MGET, only when marked) ---

    async def _vet_redrives(self, deliveries: Sequence[Delivery]) -> Sequence[Delivery]:
        """Drop ``x-redrive-of`` from fresh records the worker's redrive did not send.

        Anyone may produce that header; only ``service dlq redrive`` writes the ticket it
        names. Without one the record is exactly the record without the header. Retries
        were vetted when fresh (their stored headers are the vetted ones).
        """
        marked: list[tuple[int, RedriveTicket | None]] = [
            (i, self._ticket(d))
            for i, d in enumerate(deliveries)
            if d.headers and not d.is_retry and any(k == REDRIVE_HEADER for k, _ in d.headers)
        ]
        if not marked:
            return deliveries
        tickets = [t for _, t in marked if t is not None]
        valid = iter(await self._idem.valid_tickets(tickets) if tickets else [])
        out = list(deliveries)
        for i, ticket in marked:
            if ticket is None or not next(valid):
                out[i] = replace(out[i], headers=without_redrive(out[i].headers))
        return out

    def _ticket(self, d: Delivery) -> RedriveTicket | None:
        of = redrive_of(d.headers) if d.headers else None
        if of is None:
            return None
        key = RedisKeys(self._key_prefix).redrive_ticket(of)
        return RedriveTicket(key, redrive_ticket_value(d.topic, d.value))

    # --- stage 1: route and decode (no I/O) ---

    def _prepare(self, d: Delivery) -> _Job:
        job = _Job(delivery=d)
        handler = self._registry.for_topic(d.topic)
        if handler is None:
            job.dead_letter("unroutable", f"no handler for topic {d.topic!r}")
            return job
        job.handler = handler
        payload = decode(handler, d, self._settings.max_record_bytes)
        if isinstance(payload, DecodeFailure):
            job.dead_letter(payload.reason, payload.detail)
            return job
        try:
            dedupe_key = handler.key_of(payload)
        except Exception as exc:  # a callable dedupe_key that rejects the payload
            job.dead_letter("malformed", f"dedupe key: {describe_error(exc)}")
            return job
        if not dedupe_key:
            job.dead_letter("malformed", "dedupe key is empty")
            return job
        job.payload = payload
        job.dedupe_key = dedupe_key
        idem = self._settings.idempotency
        if idem.ttl_s is not None:
            beyond = idem.window_refusal(d.timestamp_ms, now_ms())
            if beyond is not None:
                # Its done-marker may have expired: granting it could grant a second time.
                job.dead_letter("beyond_dedupe_window", beyond)
                return job
        job.idem_key = self._idem.key(handler.name, dedupe_key)
        job.token = self._idem.tokens.next()
        job.fingerprint = fingerprint(payload)
        # A (vetted) redrive must claim: only a claim may take over a dead-letter marker.
        job.optimistic = handler.effects_only and not _is_redrive(d)
        return job

    # --- stage 2: claim the dedupe keys (one script call) ---

    async def _claim(self, wave: list[_Job]) -> None:
        """Claim every key but the effects-only handlers' (their finish does the checks)."""
        await self._claim_jobs([j for j in wave if not j.optimistic])

    async def _claim_failed(self, wave: list[_Job]) -> None:
        """Effects-only deliveries whose handler failed claim now, before their fate is kept.

        Without a claim, a duplicate of a completed payment runs its handler too; should
        that fail, the claim finds the done-marker and the record is a duplicate, rather than
        a dead letter or a retry for something already granted.
        """
        failed = [j for j in wave if j.optimistic and j.fate in (_Fate.PARK, _Fate.DEAD_LETTER)]
        for job in failed:
            job.optimistic = False
        await self._claim_jobs(failed)

    async def _claim_jobs(self, claiming: list[_Job]) -> None:
        if not claiming:
            return
        # The lease starts when Redis runs the script, after this: it surely lasts till here.
        lease_ends = time.monotonic() + self._settings.idempotency.lease_ms / 1000
        statuses = await self._idem.claim_many(
            [
                ClaimRequest(j.idem_key, j.token, j.fingerprint, self._ticket(j.delivery))
                for j in claiming
            ]
        )
        busy_ms = self._settings.retry.busy_delay_ms
        for job, status in zip(claiming, statuses, strict=True):
            if status is ClaimStatus.CLAIMED:
                job.holds_claim = True
                job.claim_until = lease_ends
            elif status in (ClaimStatus.DONE, ClaimStatus.DEAD):
                job.fate, job.reason = _Fate.DUPLICATE, status.value
            elif status is ClaimStatus.CONFLICT:
                job.dead_letter("conflict", _conflict(job))
            elif status is ClaimStatus.PARTIAL:  # the delivery that applied them died
                job.dead_letter("effects_partial", _PARTIAL_EARLIER)
            else:  # BUSY: another delivery of this key is running; park briefly, same attempt
                job.park(job.delivery.attempt, "busy: key claimed by another delivery", busy_ms)

    # --- stage 3: run the handlers (sync inline, async as bounded tasks) ---

    async def _handle(self, jobs: list[_Job]) -> None:
        inject = self._settings.fault_injection
        later: list[tuple[_Job, Context, bool]] = []
        inline = Counter[str]()  # handler name -> inline runs
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
                handler.run_sync(payload, ctx)
            except Exception as exc:
                self._failed(job, exc)
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

    def _timeout_of(self, job: _Job) -> float:
        assert job.handler is not None
        return job.handler.timeout_s or self._settings.handler_timeout_s

    async def _run_async(
        self, job: _Job, ctx: Context, hang: bool, limit_s: float, slot: Slot
    ) -> None:
        """One async handler on a pool runner, under its timeout; records its own failure."""
        assert job.handler is not None and job.payload is not None
        if (job.holds_claim or job.delivery.is_retry) and not await self._renew_leases(
            job, limit_s
        ):
            return
        started = time.perf_counter()
        try:
            with slot.deadline(limit_s):
                if hang:
                    log.warning(faults.HANG_STARTED, extra=_log_fields(job))
                    await asyncio.Event().wait()
                # Handler.__call__, inlined on the hot path.
                result = job.handler.func(job.payload, ctx)
                if result is not None:
                    await result
        except TimeoutError as exc:
            self._failed(job, exc, f"handler timed out after {limit_s:g} s")
        except Exception as exc:
            self._failed(job, exc)
        finally:
            self._latency_of(job.name).observe(time.perf_counter() - started)

    async def _renew_leases(self, job: _Job, limit_s: float) -> bool:
        """Make the claim and retry lease outlast the handler about to start, or park.

        Both were taken when the wave was claimed, but the record may have waited for a
        runner since, while its timeout only starts now: without this a lease could end
        mid-run and another delivery of the key run beside it. A fresh claim with time to
        spare costs nothing; otherwise one script stretches both, only while still ours.
        Returns False (the record parked, same attempt) when one was already lost.
        """
        need_ms = math.ceil(limit_s * 1000) + LEASE_MARGIN_MS
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

    def _context(self, job: _Job) -> Context:
        d = job.delivery
        assert job.handler is not None
        # Scoped: the handler's effects may write only under its own namespaces.
        effects = job.effects = Effects([], self._key_prefix, job.handler.namespaces)
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

    def _failed(self, job: _Job, exc: BaseException, error: str | None = None) -> None:
        """A handler error: dead-letter if permanent or out of attempts, else park.

        Its text is recorded (dead-letter header, log, retry item, outcome event) only as
        ``describe_error`` makes it: public message if declared, redacted, bounded.
        """
        assert job.handler is not None
        error = error or describe_error(exc)
        if job.handler.classify(exc) == "fail":
            job.dead_letter("permanent", error)
        else:
            self._retry_or_give_up(job, error)

    def _retry_or_give_up(self, job: _Job, error: str) -> None:
        error = record_text(error)  # e.g. a Redis error echoing an effect's arguments
        attempt = job.delivery.attempt
        if attempt >= self._settings.retry.max_attempts:
            job.dead_letter("exhausted", error)
        else:
            job.park(attempt + 1, error, backoff_ms(attempt, self._settings.retry))

    def _latency_of(self, name: str) -> Any:
        child = self._latency.get(name)
        if child is None:
            child = self._latency[name] = self._metrics.handler_seconds.labels(name)
        return child

    # --- stage 4: effects + done-markers (one script call) ---

    async def _finish(self, wave: list[_Job]) -> None:
        """Succeeded handlers commit their effects; duplicate retries drop their item."""
        done = [j for j in wave if j.fate is None]
        stale = [j for j in wave if j.fate is _Fate.DUPLICATE and j.delivery.is_retry]
        requests = [
            FinishRequest(
                key=j.idem_key,
                token=j.token,
                fingerprint=j.fingerprint,
                retry_id=j.delivery.retry_id if j.delivery.is_retry else "",
                effects=j.effects.commands if j.effects is not None and j.fate is None else [],
            )
            for j in (*done, *stale)
        ]
        if not requests:
            return
        results = await self._idem.finish_many(requests)
        busy_ms = self._settings.retry.busy_delay_ms
        for job, (status, detail) in zip(done, results, strict=False):
            if status is FinishStatus.OK:
                job.fate = _Fate.SUCCEEDED
            elif status in (FinishStatus.DONE, FinishStatus.DEAD):
                job.fate, job.reason = _Fate.DUPLICATE, status.value
            elif status is FinishStatus.CONFLICT:
                job.dead_letter("conflict", _conflict(job))
            elif status is FinishStatus.PARTIAL:
                # Its done-marker is written: no run will ever apply these effects again.
                job.dead_letter(
                    "effects_partial",
                    f"an effect failed in Redis after others were applied: {detail}",
                )
            elif status is FinishStatus.SUPERSEDED:
                why = "busy: key claimed by another delivery"
                if job.holds_claim:
                    why = "superseded: claim lease expired"
                job.holds_claim = False
                job.park(job.delivery.attempt, why, busy_ms)
            else:
                self._retry_or_give_up(job, f"effect failed in Redis: {detail}")

    # --- stage 5: park retryable records in the delay queue (one script call) ---

    async def _park(self, jobs: list[_Job]) -> None:
        if not jobs:
            return
        now = now_ms()
        requests = [
            ParkRequest(
                delivery=replace(
                    j.delivery,
                    attempt=j.next_attempt,
                    first_failed_ms=j.delivery.first_failed_ms or now,
                    last_error=j.reason,
                ),
                delay_ms=j.delay_ms,
                idem_key=j.idem_key,
                token=j.token if j.holds_claim else "",
            )
            for j in jobs
        ]
        for job, status in zip(jobs, await self._retries.park_many(requests), strict=True):
            job.outcome = Outcome.RETRY_SCHEDULED
            if status is ParkStatus.LOST_LEASE:
                log.warning(
                    "retry lease expired before the retry finished; another run owns it",
                    extra=_log_fields(job),
                )

    # --- stage 6: dead letters, acknowledged, then marked in Redis ---

    async def _dead_letter(self, jobs: list[_Job]) -> None:
        if not jobs:
            return
        at = now_ms()
        for job in jobs:
            log.warning(
                "dead-lettering record",
                extra={**_log_fields(job), "reason": job.reason, "error": job.detail},
            )
        await asyncio.gather(
            *(
                self._publisher.dead_letter(
                    j.delivery,
                    reason=j.reason or "",
                    error=j.detail,
                    handler=j.name,
                    dedupe_key=j.dedupe_key,
                    at_ms=at,
                )
                for j in jobs
            )
        )
        # Only now, with every dead letter acknowledged, may Redis forget the records.
        # A key is marked dead when we hold its claim, or, for an effects-only delivery
        # (never claimed), when no other delivery has claimed or completed it; a partial
        # apply's marker is settled, so later deliveries are duplicates.
        marks = [
            DeadRequest(
                key=j.idem_key if marks_key else "",
                token=j.token if marks_key else "",
                fingerprint=j.fingerprint if marks_key else "",
                retry_id=j.delivery.retry_id if j.delivery.is_retry else "",
            )
            for j in jobs
            for marks_key in [j.holds_claim or j.optimistic or j.reason == "effects_partial"]
            if marks_key or j.delivery.is_retry
        ]
        if marks:
            await self._idem.mark_dead_many(marks)
        for job in jobs:
            job.outcome = Outcome.DEAD_LETTERED
            self._metrics.dead_letters.labels(job.name, job.reason or "").inc()

    # --- stage 7: outcome events (one producer batch per partition) ---

    async def _emit(self, jobs: list[_Job]) -> None:
        for job in jobs:
            if job.fate is _Fate.SUCCEEDED:
                job.outcome = Outcome.SUCCEEDED
            elif job.fate is _Fate.DUPLICATE:
                job.outcome = Outcome.DUPLICATE
        if self._publisher.emits_outcomes:
            at_ms = now_ms()
            await self._publisher.outcomes(
                [
                    encode_outcome(
                        j.delivery,
                        j.outcome or Outcome.DEAD_LETTERED,
                        j.name,
                        j.dedupe_key,
                        None if j.fate is _Fate.SUCCEEDED else j.reason,
                        at_ms,
                    )
                    for j in jobs
                ]
            )
        counts = Counter((j.name, j.outcome or Outcome.DEAD_LETTERED) for j in jobs)
        for (name, outcome), n in counts.items():
            self._metrics.records.labels(name, outcome.value).inc(n)


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
    ops = RedisOps(client, settings.redis, stalls=stalls)
    producer = make_producer(settings.kafka)
    processor: Processor | None = None
    try:
        for warning in await ops.call(ops.check_persistence):
            log.warning(warning)
        await producer.start()
        processor = Processor.build(
            settings,
            registry,
            ops=ops,
            producer=producer,
            metrics=metrics or Metrics(),
            stalls=stalls,
        )
        yield processor
    finally:
        ops.stopping = True
        if processor is not None:
            await processor.aclose()
        await producer.stop()
        await client.aclose()


def _waves(jobs: list[_Job]) -> list[list[_Job]]:
    """Split so that records sharing a Kafka key land in successive waves, in order."""
    keys = [job.delivery.key for job in jobs]
    if None not in keys and len(set(keys)) == len(keys):
        return [jobs]  # the common case: every key once
    waves: list[list[_Job]] = []
    seen: Counter[bytes] = Counter()
    for job in jobs:
        key = job.delivery.key
        n = 0
        if key is not None:
            n = seen[key]
            seen[key] += 1
        if n == len(waves):
            waves.append([])
        waves[n].append(job)
    return waves


_PARTIAL_EARLIER = (
    "an earlier delivery applied this record's effects in part and its dead letter was "
    "never acknowledged"
)


def _conflict(job: _Job) -> str:
    return f"dedupe key {job.dedupe_key!r} was already used for a different payload"


def _is_redrive(d: Delivery) -> bool:
    return bool(d.headers) and any(k == REDRIVE_HEADER for k, _ in d.headers)


def _log_fields(job: _Job) -> dict[str, object]:
    d = job.delivery
    return {
        "topic": d.topic,
        "partition": d.partition,
        "offset": d.offset,
        "attempt": d.attempt,
        "dedupe_key": job.dedupe_key,
    }
