"""One record's path: decode -> claim -> handle -> done | retry | dead letter.

``Processor.process`` takes a delivery (fresh from Kafka or a due retry) and returns
only once the record's fate is durable: effects and done-marker written, parked in
the delay queue, or acknowledged by the dead-letter topic; and, when outcomes are on,
its outcome event acknowledged. Only then may its offset count as done.

Failures of the record (bad payload, handler errors) are decided here. Failures of
the infrastructure (Redis or Kafka not answering) are not the record's fault: they
are retried below this layer, and the record simply stays in flight meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from typing import Any

from pydantic import BaseModel, ValidationError
from redis.asyncio import Redis

from service import faults
from service.context import Context, Effects
from service.idempotency import (
    ClaimRequest,
    ClaimStatus,
    DeadRequest,
    FinishRequest,
    FinishStatus,
    Idempotency,
    fingerprint,
)
from service.metrics import Metrics
from service.publisher import Publisher
from service.records import Delivery, Outcome
from service.registry import Handler, Registry
from service.retries import ParkRequest, ParkStatus, RetryQueue, backoff_ms, now_ms
from service.settings import Settings

log = logging.getLogger(__name__)

REDRIVE_HEADER = "x-redrive-of"


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
        payload: BaseModel = handler.model.model_validate_json(value)
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


@dataclass(slots=True)
class _Claimed:
    """A delivery that holds the claim on its dedupe key."""

    delivery: Delivery
    handler: Handler[Any]
    dedupe_key: str
    idem_key: str
    token: str
    fingerprint: str


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

    async def process(self, d: Delivery) -> Outcome:
        handler = self._registry.for_topic(d.topic)
        if handler is None:
            return await self._dead_letter(
                d, None, None, reason="unroutable", error=f"no handler for topic {d.topic!r}"
            )
        payload = decode(handler, d, self._settings.max_record_bytes)
        if isinstance(payload, DecodeFailure):
            return await self._dead_letter(
                d, handler, None, reason=payload.reason, error=payload.detail
            )
        try:
            dedupe_key = handler.key_of(payload)
        except Exception as exc:  # a callable dedupe_key that rejects the payload
            return await self._dead_letter(
                d, handler, None, reason="malformed", error=f"dedupe key: {exc}"
            )
        if not dedupe_key:
            return await self._dead_letter(
                d, handler, None, reason="malformed", error="dedupe key is empty"
            )

        claim = _Claimed(
            delivery=d,
            handler=handler,
            dedupe_key=dedupe_key,
            idem_key=self._idem.key(handler.name, dedupe_key),
            token=self._idem.tokens.next(),
            fingerprint=fingerprint(payload),
        )
        status = await self._idem.claim(
            ClaimRequest(
                key=claim.idem_key,
                token=claim.token,
                fingerprint=claim.fingerprint,
                over_dead=_is_redrive(d),
            )
        )
        if status in (ClaimStatus.DONE, ClaimStatus.DEAD):
            if d.is_retry:  # the key finished elsewhere: drop this retry item
                await self._finish(claim, Effects())
            return await self._emit(d, Outcome.DUPLICATE, handler, dedupe_key, status.value)
        if status is ClaimStatus.CONFLICT:
            return await self._dead_letter(
                d,
                handler,
                None,
                reason="conflict",
                error=f"dedupe key {dedupe_key!r} was already used for a different payload",
                dedupe_key=dedupe_key,
            )
        if status is ClaimStatus.BUSY:
            # Another delivery of this key is running; park this one briefly, same attempt.
            return await self._park(
                claim,
                attempt=d.attempt,
                error="busy: key claimed by another delivery",
                delay_ms=self._settings.retry.busy_delay_ms,
                holding=False,
            )
        return await self._run(claim, payload)

    async def _run(self, claim: _Claimed, payload: BaseModel) -> Outcome:
        d, handler = claim.delivery, claim.handler
        effects = Effects()
        ctx = Context(
            topic=d.topic,
            partition=d.partition,
            offset=d.offset,
            key=d.key,
            headers=d.headers,
            timestamp_ms=d.timestamp_ms,
            attempt=d.attempt,
            dedupe_key=claim.dedupe_key,
            effects=effects,
            redis=self._redis,
            key_prefix=self._settings.redis.key_prefix,
        )
        timeout = handler.timeout_s or self._settings.handler_timeout_s
        started = time.perf_counter()
        try:
            async with asyncio.timeout(timeout):
                if self._settings.fault_injection:
                    await faults.inject(ctx)
                await handler(payload, ctx)
        except Exception as exc:
            self._metrics.handler_seconds.labels(handler.name).observe(
                time.perf_counter() - started
            )
            error = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, TimeoutError):
                error = f"handler timed out after {timeout:g} s"
            if handler.classify(exc) == "fail":
                return await self._dead_letter(d, handler, claim, reason="permanent", error=error)
            return await self._retry_or_give_up(claim, error)
        self._metrics.handler_seconds.labels(handler.name).observe(time.perf_counter() - started)

        status, detail = await self._finish(claim, effects)
        if status is FinishStatus.OK:
            return await self._emit(d, Outcome.SUCCEEDED, handler, claim.dedupe_key, None)
        if status in (FinishStatus.DONE, FinishStatus.DEAD):
            return await self._emit(d, Outcome.DUPLICATE, handler, claim.dedupe_key, status.value)
        if status is FinishStatus.SUPERSEDED:
            return await self._park(
                claim,
                attempt=d.attempt,
                error="superseded: claim lease expired",
                delay_ms=self._settings.retry.busy_delay_ms,
                holding=False,
            )
        return await self._retry_or_give_up(claim, f"effect failed in Redis: {detail}")

    async def _finish(self, claim: _Claimed, effects: Effects) -> tuple[FinishStatus, str | None]:
        d = claim.delivery
        return await self._idem.finish(
            FinishRequest(
                key=claim.idem_key,
                token=claim.token,
                fingerprint=claim.fingerprint,
                retry_id=d.retry_id if d.is_retry else "",
                effects=effects.commands,
            )
        )

    async def _retry_or_give_up(self, claim: _Claimed, error: str) -> Outcome:
        d = claim.delivery
        if d.attempt >= self._settings.retry.max_attempts:
            return await self._dead_letter(d, claim.handler, claim, reason="exhausted", error=error)
        return await self._park(
            claim,
            attempt=d.attempt + 1,
            error=error,
            delay_ms=backoff_ms(d.attempt, self._settings.retry),
            holding=True,
        )

    async def _park(
        self, claim: _Claimed, *, attempt: int, error: str, delay_ms: int, holding: bool
    ) -> Outcome:
        d = claim.delivery
        now = now_ms()
        next_run = replace(
            d, attempt=attempt, first_failed_ms=d.first_failed_ms or now, last_error=error
        )
        status = await self._retries.park(
            ParkRequest(
                delivery=next_run,
                due_ms=now + delay_ms,
                idem_key=claim.idem_key,
                token=claim.token if holding else "",
            )
        )
        if status is ParkStatus.LOST_LEASE:
            log.warning(
                "retry lease expired before the retry finished; another run owns it",
                extra=_log_fields(d, claim.dedupe_key),
            )
        return await self._emit(d, Outcome.RETRY_SCHEDULED, claim.handler, claim.dedupe_key, error)

    async def _dead_letter(
        self,
        d: Delivery,
        handler: Handler[Any] | None,
        claim: _Claimed | None,
        *,
        reason: str,
        error: str,
        dedupe_key: str | None = None,
    ) -> Outcome:
        name = handler.name if handler else ""
        key = claim.dedupe_key if claim else dedupe_key
        log.warning(
            "dead-lettering record", extra={**_log_fields(d, key), "reason": reason, "error": error}
        )
        await self._publisher.dead_letter(
            d, reason=reason, error=error, handler=name, dedupe_key=key, at_ms=now_ms()
        )
        if claim is not None or d.is_retry:
            # Only now, with the dead letter acknowledged, may Redis forget the record.
            await self._idem.mark_dead(
                DeadRequest(
                    key=claim.idem_key if claim else "",
                    token=claim.token if claim else "",
                    fingerprint=claim.fingerprint if claim else "",
                    retry_id=d.retry_id if d.is_retry else "",
                )
            )
        self._metrics.dead_letters.labels(name, reason).inc()
        return await self._emit(d, Outcome.DEAD_LETTERED, handler, key, reason)

    async def _emit(
        self,
        d: Delivery,
        outcome: Outcome,
        handler: Handler[Any] | None,
        dedupe_key: str | None,
        reason: str | None,
    ) -> Outcome:
        name = handler.name if handler else ""
        await self._publisher.outcome(
            d, event=outcome, handler=name, dedupe_key=dedupe_key, reason=reason, at_ms=now_ms()
        )
        self._metrics.records.labels(name, outcome.value).inc()
        return outcome


def _is_redrive(d: Delivery) -> bool:
    return any(k == REDRIVE_HEADER for k, _ in d.headers)


def _log_fields(d: Delivery, dedupe_key: str | None) -> dict[str, object]:
    return {
        "topic": d.topic,
        "partition": d.partition,
        "offset": d.offset,
        "attempt": d.attempt,
        "dedupe_key": dedupe_key,
    }
