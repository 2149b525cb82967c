"""The Processor's decisions: what becomes of each record, and making that durable.

Stage by stage, one Redis or Kafka call per batch: vet redrive marks, route and decode,
claim the dedupe keys, then (after the handlers ran, processing.py) finish the
succeeded, park the retryable, dead-letter the rest, and emit one outcome event each.
Failures of the record (bad payload, handler errors, conflicts) are decided here;
failures of Redis or Kafka are retried beneath (``RedisOps``, ``Publisher``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from reliable_consumer.engine.batch.decoding import DecodeFailure, decode
from reliable_consumer.engine.batch.jobs import Fate, Job, log_fields
from reliable_consumer.engine.batch.parts import Parts
from reliable_consumer.engine.handlers.emissions import Emission
from reliable_consumer.engine.handlers.policies import RetryPolicy
from reliable_consumer.engine.handlers.redaction import describe_error, record_text
from reliable_consumer.engine.handlers.registry import Handler
from reliable_consumer.engine.records import (
    REDRIVE_HEADER,
    Delivery,
    Outcome,
    redrive_of,
    redrive_ticket_value,
    without_redrive,
)
from reliable_consumer.engine.redis.delay_queue import ParkRequest, ParkStatus, now_ms
from reliable_consumer.engine.redis.idempotency import (
    ClaimRequest,
    ClaimStatus,
    DeadRequest,
    DeadStatus,
    FinishRequest,
    FinishStatus,
    RedriveTicket,
    fingerprint,
)
from reliable_consumer.engine.schemas.wire import schema_id_of

log = logging.getLogger(__name__)


class Decisions:
    """The stages of a batch that decide fates and write them to Redis and Kafka."""

    def __init__(self, parts: Parts) -> None:
        settings, registry = parts.settings, parts.registry
        self._settings = settings
        self._registry = registry
        self._idem = parts.idempotency
        self._retries = parts.retries
        self._publisher = parts.publisher
        self._metrics = parts.metrics
        self._keys = parts.keys
        self._schemas = parts.schemas
        default = settings.retry.policy()
        self._policies: dict[str, RetryPolicy] = {
            h.name: h.retry or default for _, h in registry.items()
        }
        self._ordered: dict[str, bool] = {
            h.name: _keeps_key_order(h, settings.ordering) for _, h in registry.items()
        }

    def policy(self, handler: str) -> RetryPolicy:
        """The handler's retry policy: its own, or the settings' (WORKER_RETRY__*)."""
        return self._policies.get(handler) or self._settings.retry.policy()

    # --- stage 0: a redrive is one only with its ticket (one MGET, only when marked) ---

    async def vet_redrives(self, deliveries: Sequence[Delivery]) -> Sequence[Delivery]:
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
        key = self._keys.redrive_ticket(of)
        return RedriveTicket(key, redrive_ticket_value(d.topic, d.value))

    # --- stage 1: fetch the writers' schemas the batch names (only ids not yet known) ---

    async def fetch_writer_schemas(
        self, deliveries: Sequence[Delivery], give_up: Callable[[], bool]
    ) -> None:
        """Make every writer's schema the batch's registry-framed values name known.

        Decoding then never waits on the network. While the registry does not answer this
        waits (the batch uncommitted, the ``schema_registry`` stall reported).
        """
        if self._schemas is None:
            return
        ids: set[int] = set()
        for d in deliveries:
            handler = self._registry.for_topic(d.topic)
            if handler is None or handler.value_format is None or d.value is None:
                continue
            schema_id = schema_id_of(d.value)
            if schema_id is not None:
                ids.add(schema_id)
        if ids:
            await self._schemas.ensure(ids, give_up)

    # --- stage 1: route and decode (no I/O) ---

    def prepare(self, d: Delivery) -> Job:
        job = Job(delivery=d)
        handler = self._registry.for_topic(d.topic)
        if handler is None:
            job.dead_letter("unroutable", f"no handler for topic {d.topic!r}")
            return job
        job.handler = handler
        payload = decode(handler, d, self._settings.max_record_bytes, self._schemas)
        if isinstance(payload, DecodeFailure):
            job.dead_letter(payload.reason, payload.detail)
            return job
        try:
            dedupe_key = handler.key_of(payload, d.headers)
        except Exception as exc:  # a callable dedupe_key that rejects it, a header missing
            job.dead_letter("malformed", f"dedupe key: {describe_error(exc)}")
            return job
        if not dedupe_key:
            job.dead_letter("malformed", "dedupe key is empty")
            return job
        job.payload = payload
        job.dedupe_key = dedupe_key
        if d.is_retry:
            job.chain = d.chain  # its chain was decided when it was first parked
        elif d.key is not None and self._ordered.get(handler.name, False):
            job.chain = self._keys.retry_chain(d.topic, d.partition, d.key)
        idem = self._settings.idempotency
        # A postgres handler's inbox rows are kept until pruned: no dedupe window to refuse.
        if idem.ttl_s is not None and handler.store != "postgres":
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

    async def claim(self, wave: list[Job]) -> None:
        """Claim every key but the effects-only handlers' (their finish does the checks)."""
        await self._claim_jobs([j for j in wave if not j.optimistic and j.fate is None])

    async def claim_failed(self, wave: list[Job]) -> None:
        """Effects-only deliveries whose handler failed claim now, before their fate is kept.

        Without a claim, a duplicate of a completed record runs its handler too; should
        that fail, the claim finds the done-marker and the record is a duplicate, rather than
        a dead letter or a retry for something already granted.
        """
        failed = [j for j in wave if j.optimistic and j.fate in (Fate.PARK, Fate.DEAD_LETTER)]
        for job in failed:
            job.optimistic = False
        await self._claim_jobs(failed)

    async def _claim_jobs(self, claiming: list[Job]) -> None:
        if not claiming:
            return
        # The lease starts when Redis runs the script, after this: it surely lasts till here.
        lease_ends = time.monotonic() + self._settings.idempotency.lease_ms / 1000
        statuses = await self._idem.claim_many(
            [
                ClaimRequest(
                    j.idem_key,
                    j.token,
                    j.fingerprint,
                    self._ticket(j.delivery),
                    "" if j.delivery.is_retry else j.chain,
                )
                for j in claiming
            ]
        )
        busy_ms = self._settings.retry.busy_delay_ms
        for job, status in zip(claiming, statuses, strict=True):
            if status is ClaimStatus.CLAIMED:
                job.holds_claim = True
                job.claim_until = lease_ends
            elif status in (ClaimStatus.DONE, ClaimStatus.DEAD):
                job.fate, job.reason = Fate.DUPLICATE, status.value
            elif status is ClaimStatus.CONFLICT:
                job.dead_letter("conflict", _conflict(job))
            elif status is ClaimStatus.PARTIAL:  # the delivery that applied them died
                job.dead_letter("effects_partial", _PARTIAL_EARLIER)
            elif status is ClaimStatus.BLOCKED:
                job.park_behind()
            else:  # BUSY: another delivery of this key is running; park briefly, same attempt
                job.park(job.delivery.attempt, "busy: key claimed by another delivery", busy_ms)

    def handler_failed(self, job: Job, error: str, *, permanent: bool, held: bool) -> None:
        """A handler error: dead-letter if permanent or out of attempts, else park; or hold.

        ``permanent``: the handler's declarations classify the error as one no retry can
        mend. ``held``: its circuit breaker, told of this failure by the runner (runner.py),
        is open or would not let the record be parked: the record is held (Fate.HOLD), the
        dependency is down, and neither a park nor an attempt is spent. ``error`` is already
        the text ``describe_error`` made of it.
        """
        if permanent:
            job.dead_letter("permanent", error)
            return
        if held:
            self._hold(job, error)
            return
        self.retry_or_give_up(job, error)

    def _hold(self, job: Job, error: str) -> None:
        """A failed run while the circuit is open (or this failure opened it): hold it.

        The run counts as an attempt of the record, under its retry policy: a record failing
        for reasons of its own, held and probed again and again, would otherwise keep the
        circuit open forever. A fresh record is held in memory (its offset uncommitted,
        nothing parked); a retry is in the delay queue already and goes back there as usual.
        Records the open circuit never let run spend nothing (gate.py).
        """
        d = job.delivery
        if d.is_retry:
            self.retry_or_give_up(job, error)
            return
        error = record_text(error)
        now = now_ms()
        spent = self.policy(job.name).spent(d.attempt, d.first_failed_ms, now)
        if spent is not None:
            job.dead_letter("exhausted", f"{error} (retries spent: {spent})")
            return
        job.delivery = replace(
            d, attempt=d.attempt + 1, first_failed_ms=d.first_failed_ms or now, last_error=error
        )
        job.fate, job.reason = Fate.HOLD, error

    def requeue(self, job: Job, why: str) -> None:
        """Back to the delay queue at the same attempt, soon: the record did not fail through
        a fault of its own (its postgres transaction was broken by a wave-mate's handler, or
        lost with the connection of a call abandoned past its timeout), so no attempt is spent
        and no breaker hears of it."""
        job.park(job.delivery.attempt, why, self._settings.retry.busy_delay_ms)

    def retry_or_give_up(self, job: Job, error: str) -> None:
        """Park for another run, unless the handler's retry policy is spent."""
        error = record_text(error)  # e.g. a Redis error echoing an effect's arguments
        d = job.delivery
        policy = self.policy(job.name)
        now = now_ms()
        spent = policy.spent(d.attempt, d.first_failed_ms, now)
        if spent is not None:
            job.dead_letter("exhausted", f"{error} (retries spent: {spent})")
        else:
            job.park(d.attempt + 1, error, policy.next_delay_ms(d.attempt, d.first_failed_ms, now))

    # --- stage 4: effects + done-markers (one script call) ---

    async def finish(self, wave: list[Job]) -> None:
        """Succeeded handlers commit their effects; duplicate retries drop their item."""
        done = [j for j in wave if j.fate is None]
        stale = [j for j in wave if j.fate is Fate.DUPLICATE and j.delivery.is_retry]
        requests = [
            FinishRequest(
                key=j.idem_key,
                token=j.token,
                fingerprint=j.fingerprint,
                retry_id=j.delivery.retry_id if j.delivery.is_retry else "",
                effects=j.effects.commands if j.effects is not None and j.fate is None else [],
                chain=j.chain,
                emissions=_redis_emissions(j),
                emitted_by=j.name,
            )
            for j in (*done, *stale)
        ]
        if not requests:
            return
        results = await self._idem.finish_many(requests)
        busy_ms = self._settings.retry.busy_delay_ms
        for job, (status, detail) in zip(done, results, strict=False):
            if job.committed:
                # Its effects and inbox row are committed in PostgreSQL, whatever Redis says:
                # FINISH only marked the key done, dropped its retry item, released its chain.
                job.fate = Fate.DUPLICATE if job.inbox_duplicate else Fate.SUCCEEDED
                if job.inbox_duplicate:
                    job.reason = FinishStatus.DONE.value
                if status not in (FinishStatus.OK, FinishStatus.DONE):
                    log.warning(
                        "committed in PostgreSQL; Redis FINISH said %s",
                        status.value,
                        extra=log_fields(job),
                    )
            elif status is FinishStatus.OK:
                job.fate = Fate.SUCCEEDED
            elif status in (FinishStatus.DONE, FinishStatus.DEAD):
                job.fate, job.reason = Fate.DUPLICATE, status.value
            elif status is FinishStatus.CONFLICT:
                job.dead_letter("conflict", _conflict(job))
            elif status is FinishStatus.PARTIAL:
                # Its done-marker is written: no run will ever apply these effects again.
                job.dead_letter(
                    "effects_partial",
                    f"an effect failed in Redis after others were applied: {detail}",
                )
            elif status is FinishStatus.BLOCKED:  # nothing applied; the claim goes at PARK
                job.park_behind()
            elif status is FinishStatus.SUPERSEDED:
                why = "busy: key claimed by another delivery"
                if job.holds_claim:
                    why = "superseded: claim lease expired"
                job.holds_claim = False
                job.park(job.delivery.attempt, why, busy_ms)
            else:
                self.retry_or_give_up(job, f"effect failed in Redis: {detail}")

    # --- stage 5: park retryable records in the delay queue (one script call) ---

    async def park(self, jobs: list[Job]) -> None:
        if not jobs:
            return
        now = now_ms()
        requests = [
            ParkRequest(
                delivery=replace(
                    j.delivery,
                    attempt=j.next_attempt,
                    # Waiting behind its key is no failure: no clock starts, no error is kept.
                    first_failed_ms=j.delivery.first_failed_ms or (None if j.blocked else now),
                    last_error=j.delivery.last_error if j.blocked else j.reason,
                    chain=j.chain,
                ),
                delay_ms=j.delay_ms,
                idem_key=j.idem_key,
                token=j.token if j.holds_claim else "",
                handler=j.name,
            )
            for j in jobs
        ]
        for job, status in zip(jobs, await self._retries.park_many(requests), strict=True):
            job.outcome = Outcome.RETRY_SCHEDULED
            if status is ParkStatus.LOST_LEASE:
                log.warning(
                    "retry lease expired before the retry finished; another run owns it",
                    extra=log_fields(job),
                )

    # --- stage 6: dead letters, acknowledged, then marked in Redis ---

    async def dead_letter(self, jobs: list[Job]) -> None:
        if not jobs:
            return
        at = now_ms()
        for job in jobs:
            log.warning(
                "dead-lettering record",
                extra={**log_fields(job), "reason": job.reason, "error": job.detail},
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
        # apply's marker is settled, so later deliveries are duplicates. A retry's item is
        # dropped only while its lease is still ours: an ack slower than the lease leaves
        # the item to the run that took it over, which settles the key.
        marking = [j for j in jobs if _marks_key(j) or j.delivery.is_retry]
        marks = [
            DeadRequest(
                key=j.idem_key if marks_key else "",
                token=j.token if marks_key else "",
                fingerprint=j.fingerprint if marks_key else "",
                retry_id=j.delivery.retry_id if j.delivery.is_retry else "",
                chain=j.delivery.chain if j.delivery.is_retry else "",
                retry_lease=j.delivery.retry_lease,
            )
            for j in marking
            for marks_key in [_marks_key(j)]
        ]
        if marks:
            statuses = await self._idem.mark_dead_many(marks)
            for job, status in zip(marking, statuses, strict=True):
                if status is DeadStatus.LOST_LEASE:
                    log.warning(
                        "retry lease expired before its dead letter was marked; the run that "
                        "took the retry over settles it",
                        extra=log_fields(job),
                    )
        for job in jobs:
            job.outcome = Outcome.DEAD_LETTERED
            self._metrics.dead_letters.labels(job.name, job.reason or "").inc()

    # --- stage 7: outcome events (one producer batch per partition) ---

    async def emit(self, jobs: list[Job]) -> None:
        for job in jobs:
            if job.fate is Fate.SUCCEEDED:
                job.outcome = Outcome.SUCCEEDED
            elif job.fate is Fate.DUPLICATE:
                job.outcome = Outcome.DUPLICATE
        if self._publisher.emits_outcomes:
            await self._publisher.outcomes(
                [
                    (
                        j.delivery,
                        j.outcome or Outcome.DEAD_LETTERED,
                        j.name,
                        j.dedupe_key,
                        None if j.fate is Fate.SUCCEEDED else j.reason,
                    )
                    for j in jobs
                ],
                now_ms(),
            )
        counts = Counter((j.name, j.outcome or Outcome.DEAD_LETTERED) for j in jobs)
        for (name, outcome), n in counts.items():
            self._metrics.records.labels(name, outcome.value).inc(n)
        # Every fate is durable now (outcome events acknowledged): end to end, for the
        # records that are done; a parked one is not, its retry will be.
        done_ms = now_ms()
        for job in jobs:
            if job.outcome is not Outcome.RETRY_SCHEDULED:
                self._metrics.observe_done(job.name, job.delivery.timestamp_ms, done_ms)


_PARTIAL_EARLIER = (
    "an earlier delivery applied this record's effects in part and its dead letter was "
    "never acknowledged"
)


def _conflict(job: Job) -> str:
    return f"dedupe key {job.dedupe_key!r} was already used for a different payload"


def _marks_key(job: Job) -> bool:
    """Whether MARK_DEAD may mark the dead-lettered record's key (see ``dead_letter``)."""
    return job.holds_claim or job.optimistic or job.reason == "effects_partial"


def _is_redrive(d: Delivery) -> bool:
    return bool(d.headers) and any(k == REDRIVE_HEADER for k, _ in d.headers)


def _keeps_key_order(handler: Handler[Any], ordering: str) -> bool:
    """Whether the handler's retries keep per-key order (``@handler(ordering=)``, else the
    setting: "key" and "partition" keep it per key, "none" does not)."""
    if handler.ordering is not None:
        return handler.ordering == "key"
    return ordering != "none"


def _redis_emissions(job: Job) -> Sequence[Emission]:
    """What FINISH appends to the Redis outbox for ``job``: its handler's emissions when
    its effects are Redis's to apply now (a postgres handler's go to its own outbox, in
    its transaction; a duplicate's or a failed run's are never written)."""
    if job.fate is not None or job.emissions is None or job.handler is None:
        return ()
    if job.handler.store != "redis":
        return ()
    return job.emissions.emitted
