"""A handler's call, from the record's ``Context`` to what its circuit breaker hears.

Every handler call of the record path goes through ``HandlerRunner``, whichever store keeps
its effects: the Redis path's (``run``: sync handlers inline, async ones on the runner pool,
processing.py) and the postgres waves' (postgres_wave.py, which runs each call in its
record's savepoint and asks the runner for the rest). The runner owns, for each call:

- its ``Context`` (``context``), its deadline (``timeout_of``) and the leases stretched to
  outlast it as it starts (``renew_leases``);
- its latency in ``worker_handler_seconds`` (``observe``);
- what its handler's circuit breaker hears of how it ended: a success (``succeeded``), or a
  failure (``failed``), told here and nowhere else, once per call; then the record's fate
  is decisions.py's.

While late retries go first (intake.RetryPriority), or a retry falls due, a fresh wave waits
at ``run``'s door and at its checkpoints between inline calls (lane.py), and a retry wave's
async calls go ahead of the fresh ones queued for the pool.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections import Counter
from dataclasses import replace
from typing import Any

from reliable_consumer.engine.batch.decisions import Decisions
from reliable_consumer.engine.batch.jobs import Job, log_fields
from reliable_consumer.engine.batch.lane import CHECK_EVERY
from reliable_consumer.engine.batch.parts import Parts
from reliable_consumer.engine.handlers import faults
from reliable_consumer.engine.handlers.breaker import BreakerState, Failure
from reliable_consumer.engine.handlers.context import Context, Effects
from reliable_consumer.engine.handlers.emissions import Emissions
from reliable_consumer.engine.handlers.pool import HandlerPool, Slot
from reliable_consumer.engine.handlers.redaction import describe_error
from reliable_consumer.engine.handlers.stuck_calls import CallAbandoned, fence
from reliable_consumer.engine.redis.idempotency import ExtendRequest, ExtendStatus

log = logging.getLogger(__name__)

# A lease stretched as a handler starts outlives its timeout and cancel grace by this much:
# the watchdog's tick, a loaded event loop, and the finish or park that follows the handler.
LEASE_MARGIN_MS = 1_000
POSTGRES_EFFECTS_REFUSAL = (
    "this handler keeps its effects in PostgreSQL (store='postgres'): write them with SQL on "
    "ctx.db, in the transaction that also records the inbox row; ctx.effects takes nothing"
)


class HandlerRunner:
    """Runs handler calls and accounts for each: context, deadline, leases, latency, breaker."""

    def __init__(self, parts: Parts, decisions: Decisions) -> None:
        self._parts = parts
        self._settings = parts.settings
        self._decisions = decisions
        self._breakers = parts.breakers
        # Async handlers running at once, across all batches: protects what they call.
        self._pool = HandlerPool(
            parts.settings.max_concurrent_handlers,
            cancel_grace_s=parts.settings.handler_cancel_grace_s,
            stuck=parts.stuck,
        )
        self._latency: dict[str, Any] = {}  # handler name -> its histogram child
        self._key_prefix = parts.settings.redis.effective_prefix

    # --- the Redis path's calls: sync inline, async as bounded tasks ---

    async def run(self, jobs: list[Job]) -> None:
        """Every job's handler, each call's outcome told and its failure decided.

        A wave is all retries (the scheduler's) or all fresh records (the intake's): a
        fresh one first waits while late retries go first, a retry one then jumps the
        pool's queue.
        """
        if not jobs:
            return
        lane = self._parts.lane
        retries = jobs[0].delivery.is_retry
        if not retries:
            await lane.checkpoint()
        inject = self._settings.fault_injection
        later: list[tuple[Job, Context, bool]] = []
        inline = Counter[str]()  # handler name -> inline runs
        # Inline successes not yet told to their breaker, by handler and whether they were
        # first attempts: told once per batch, or before a failure of the same handler is
        # (the breaker sees the runs in the same order).
        untold = Counter[tuple[str, bool]]()
        started = time.perf_counter()
        for i, job in enumerate(jobs):
            if i and not retries and not i % CHECK_EVERY:  # a retry due meanwhile goes first
                await lane.checkpoint()
            ctx = self.context(job)
            handler, payload = job.handler, job.payload
            assert handler is not None and payload is not None
            try:
                hang = inject and faults.inject(ctx)
                if hang or handler.is_async:
                    later.append((job, ctx, hang))
                    continue
                inline[handler.name] += 1
                job.ran = True
                if job.span is None:
                    handler.run_sync(payload, ctx)
                else:  # its calls become children of the record's span
                    with job.span.current():
                        handler.run_sync(payload, ctx)
                untold[handler.name, job.delivery.attempt == 1] += 1
            except Exception as exc:
                job.ran = True
                for first in (True, False):
                    if successes := untold.pop((handler.name, first), 0):
                        self._answered(handler.name, first, successes)
                self.failed(job, exc)
        for (name, first), successes in untold.items():
            if successes:
                self._answered(name, first, successes)
        if inline:
            # Inline handlers take microseconds: one observation of the batch's mean per
            # handler keeps the histogram honest about them without a per-record cost.
            mean = (time.perf_counter() - started) / inline.total()
            for name in inline:
                self.observe(name, mean)
        if later:
            timeouts = [self.timeout_of(job) for job, _, _ in later]
            run = self._run_async
            await self._pool.run(
                [
                    functools.partial(run, job, ctx, hang, timeout)
                    for (job, ctx, hang), timeout in zip(later, timeouts, strict=True)
                ],
                shortest_timeout_s=min(timeouts),
                first=retries and lane.holding(),
            )

    async def _run_async(
        self, job: Job, ctx: Context, hang: bool, limit_s: float, slot: Slot
    ) -> None:
        """One async handler on a pool runner, under its timeout; records its own failure."""
        assert job.handler is not None and job.payload is not None
        if (job.holds_claim or job.delivery.is_retry) and not await self.renew_leases(job, limit_s):
            return
        started = time.perf_counter()
        job.ran = True
        abandon = functools.partial(self._abandoned, job, ctx, limit_s, started)
        traced = job.span.attach() if job.span is not None else None  # this runner's context
        try:
            with slot.deadline(limit_s, job.handler.name, abandon):
                if hang:
                    log.warning(faults.HANG_STARTED, extra=log_fields(job))
                    await asyncio.Event().wait()
                # Handler.__call__, inlined on the hot path.
                result = job.handler.func(job.payload, ctx)
                if result is not None:
                    await result
            self.succeeded(job)
        except TimeoutError as exc:
            self.failed(job, exc, f"handler timed out after {limit_s:g} s")
        except Exception as exc:
            self.failed(job, exc)
        finally:
            if traced is not None:
                traced.detach()
            if not slot.abandoned:  # else measured when it was abandoned
                self.observe(job.name, time.perf_counter() - started)

    def _abandoned(self, job: Job, ctx: Context, limit_s: float, started: float) -> None:
        """The pool gave up on this record's call: its fate now, as for a timeout; the call
        is fenced, since it still runs and may still queue effects."""
        fence(ctx)
        self.observe(job.name, time.perf_counter() - started)
        error = CallAbandoned(limit_s, self._settings.handler_cancel_grace_s)
        log.warning(
            "handler ignored its cancellation past the grace; its record goes on without it",
            extra={**log_fields(job), "error": str(error)},
        )
        self.failed(job, error, str(error))

    async def aclose(self) -> None:
        """Stop the pool's runners (after the batches using them have ended)."""
        await self._pool.aclose()

    # --- what every call has, on either path ---

    def context(self, job: Job) -> Context:
        """What the record's handler sees (a postgres wave adds ``ctx.db``)."""
        d = job.delivery
        assert job.handler is not None
        # Scoped: the handler's effects may write only under its own namespaces.
        effects = job.effects = Effects([], self._key_prefix, job.handler.namespaces)
        if job.handler.store == "postgres":
            effects.refusal = POSTGRES_EFFECTS_REFUSAL
        ctx = Context(  # positional: this runs once per record
            d.topic,
            d.partition,
            d.offset,
            d.key,
            d.headers,
            d.timestamp_ms,
            d.attempt,
            job.dedupe_key or "",
            effects,
            self._parts.redis,
            self._key_prefix,
        )
        if job.handler.emits:
            ctx.emissions = job.emissions = Emissions(
                job.handler.name,
                job.handler.emits,
                job.dedupe_key or "",
                limits=self._parts.emitted_limits,
            )
        return ctx

    def timeout_of(self, job: Job) -> float:
        """The call's deadline: its handler's own timeout, else the settings'."""
        assert job.handler is not None
        return job.handler.timeout_s or self._settings.handler_timeout_s

    async def renew_leases(self, job: Job, limit_s: float) -> bool:
        """Make the claim and retry lease outlast the handler about to start, or park.

        Both were taken when the wave was claimed, but the record may have waited for a
        runner since, while its timeout only starts now: without this a lease could end
        mid-run and another delivery of the key run beside it. A fresh claim with time to
        spare costs nothing; otherwise one script stretches both, only while still ours.
        Returns False (the record parked, same attempt) when one was already lost.
        """
        settings = self._settings
        # Until its fate is decided: the timeout, and the cancel grace a stuck call gets.
        need_ms = math.ceil((limit_s + settings.handler_cancel_grace_s) * 1000)
        need_ms += LEASE_MARGIN_MS
        retry_lease = job.delivery.retry_lease
        if retry_lease is None and job.claim_until - time.monotonic() >= need_ms / 1000:
            return True
        sent = time.monotonic()
        claim_ms = max(settings.idempotency.lease_ms, need_ms)
        request = ExtendRequest(
            key=job.idem_key if job.holds_claim else "",
            token=job.token,
            claim_ms=claim_ms,
            retry_id=job.delivery.retry_id if retry_lease is not None else "",
            retry_lease=retry_lease,
            retry_ms=max(settings.retry.lease_ms, need_ms),
        )
        ((status, lease),) = await self._parts.idempotency.extend_many([request])
        if status is ExtendStatus.OK:
            job.claim_until = sent + claim_ms / 1000
            if lease is not None:  # the new fencing token: PARK must present this one
                leased_until = sent + request.retry_ms / 1000
                job.delivery = replace(job.delivery, retry_lease=lease, leased_until=leased_until)
            return True
        busy_ms = settings.retry.busy_delay_ms
        if status is ExtendStatus.LOST_CLAIM:
            job.holds_claim = False
            why = "busy: claim lease expired before the handler started"
        else:  # PARK will find the lease lost too, and release our claim
            why = "superseded: retry lease expired before the handler started"
        job.park(job.delivery.attempt, why, busy_ms)
        return False

    def observe(self, name: str, seconds: float) -> None:
        """A call's time in its handler's ``worker_handler_seconds``."""
        child = self._latency.get(name)
        if child is None:
            child = self._latency[name] = self._parts.metrics.handler_seconds.labels(name)
        child.observe(seconds)

    # --- how a call ended: its breaker told once, then its record's fate decided ---

    def succeeded(self, job: Job) -> None:
        """The call returned: its breaker hears the dependency answered."""
        self._answered(job.name, job.delivery.attempt == 1)

    def failed(self, job: Job, exc: BaseException, error: str | None = None) -> None:
        """The call raised (or timed out, or was abandoned): its breaker told, its fate decided.

        A retryable failure counts against the handler's circuit breaker, which weighs a
        record's first attempt apart from its retries (breaker.py: records failing on their
        own are not an outage); a permanent one tells it the dependency answered. When the
        breaker is open, or parking a record not yet in the delay queue would spend more
        than its retry budget, the record is held (decisions.py). Its text is recorded
        (dead-letter header, log, retry item, outcome event) only as ``describe_error``
        makes it: public message if declared, redacted, bounded.
        """
        assert job.handler is not None
        error = error or describe_error(exc)
        permanent = job.handler.classify(exc) == "fail"
        held = self._told_failure(job, exc, error, permanent)
        self._decisions.handler_failed(job, error, permanent=permanent, held=held)

    def _told_failure(self, job: Job, exc: BaseException, error: str, permanent: bool) -> bool:
        """Tell the breaker how the call failed; True when its circuit now holds the record."""
        d = job.delivery
        if permanent:  # the dependency answered; the record is wrong
            self._answered(job.name, d.attempt == 1)
            return False
        breaker = self._breakers.for_handler(job.name)
        if breaker is None:
            return False
        breaker.record_failure(
            Failure(
                error,
                type(exc).__name__,
                job.idem_key or d.retry_id,
                first_attempt=d.attempt == 1,
                failing_since_ms=d.first_failed_ms,
            )
        )
        return breaker.state is not BreakerState.CLOSED or not breaker.try_park(
            new_item=not d.is_retry
        )

    def _answered(self, name: str, first_attempt: bool, runs: int = 1) -> None:
        """``runs`` calls of the handler in which its dependency answered."""
        breaker = self._breakers.for_handler(name)
        if breaker is not None:
            breaker.record_success(runs, first_attempt=first_attempt)
