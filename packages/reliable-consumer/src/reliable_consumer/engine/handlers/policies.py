"""What a handler declares about failure: how it retries, and when its dependency is down.

``RetryPolicy`` is the backoff of the delay queue and when a record's retries are spent (a
number of attempts, an age since its first failure, or whichever comes first).
``BreakerPolicy`` is the circuit breaker in front of a handler (or of a dependency several
handlers share): when retryable failures cross a threshold the worker stops taking that
handler's records, holds what it has without parking, dead-lettering or committing past
it, and probes after a cool-down. Both are declared on ``@handler``; the settings
(``WORKER_RETRY__*``, ``WORKER_BREAKER__*``) are the default for handlers that declare none.
"""

from __future__ import annotations

import math
import random
from typing import Self

from pydantic import BaseModel, ConfigDict, Field, model_validator


class RetryPolicy(BaseModel):
    """Delay before run n+1 is min(max_delay, base * multiplier**(n-1)), with ± jitter.

    Spent when the record has run ``max_attempts`` times, or when ``max_age_s`` has passed
    since its first failure: whichever comes first (at least one of the two is set).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    base_delay_ms: int = Field(default=1_000, ge=0)
    multiplier: float = Field(default=2.0, ge=1.0)
    max_delay_ms: int = Field(default=300_000, ge=0)
    jitter: float = Field(default=0.2, ge=0.0, le=1.0)
    max_attempts: int | None = Field(default=6, ge=1, le=100_000)
    max_age_s: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _bounded(self) -> Self:
        if self.max_delay_ms < self.base_delay_ms:
            raise ValueError("max_delay_ms must be >= base_delay_ms")
        if self.max_attempts is None and self.max_age_s is None:
            raise ValueError("set max_attempts, max_age_s or both: retries must end somewhere")
        return self

    @classmethod
    def patient(cls) -> RetryPolicy:
        """Hours, not seconds: a record that waits out a dependency's outage beats a dead letter.

        From 1 s doubling to every 10 minutes, for up to 12 hours since the first failure
        (about 80 runs); the circuit breaker keeps an outage from spending them. The
        settings' defaults (WORKER_RETRY__*) are this policy.
        """
        return cls(
            base_delay_ms=1_000,
            multiplier=2.0,
            max_delay_ms=600_000,
            jitter=0.2,
            max_attempts=None,
            max_age_s=12 * 3600,
        )

    def delay_ms(self, attempt: int, rng: random.Random | None = None) -> int:
        """Delay before run number ``attempt + 1``: exponential, capped, with ± jitter."""
        try:
            base = self.base_delay_ms * self.multiplier ** max(attempt - 1, 0)
        except OverflowError:  # far past any cap
            base = math.inf
        delay = min(float(self.max_delay_ms), base)
        if self.jitter:
            spread = delay * self.jitter
            delay += (rng or random).uniform(-spread, spread)
        return max(0, int(delay))

    def spent(self, attempt: int, first_failed_ms: int | None, now_ms: int) -> str | None:
        """Why no run may follow run ``attempt`` (None while one may)."""
        if self.max_attempts is not None and attempt >= self.max_attempts:
            return f"{attempt} of {self.max_attempts} attempts used"
        if self.max_age_s is not None and first_failed_ms:
            age_s = (now_ms - first_failed_ms) / 1000
            if age_s >= self.max_age_s:
                return f"failing for {age_s:.0f} s, the policy allows {self.max_age_s:g} s"
        return None

    def next_delay_ms(self, attempt: int, first_failed_ms: int | None, now_ms: int) -> int:
        """The backoff, shortened so the last run lands at the age limit, not after it."""
        delay = self.delay_ms(attempt)
        if self.max_age_s is not None and first_failed_ms:
            left = first_failed_ms + int(self.max_age_s * 1000) - now_ms
            delay = max(0, min(delay, left))
        return delay


class BreakerPolicy(BaseModel):
    """When a handler's dependency counts as down, and how the worker probes it.

    Only evidence of a dependency counts, not records failing for their own reasons (their
    retries): it opens when, within the last ``window_s``, at least ``min_calls`` first
    attempts ended and at least ``failure_ratio`` of them failed with a retryable error; or
    when no run at all succeeded while ``min_calls`` runs of as many distinct keys failed,
    ``failure_ratio`` of them with one error class (an outage seen through retries alone); or
    when parking one more record not yet in the delay queue would exceed the retry budget:
    ``max(retry_budget_min, retry_budget_ratio * first attempts in the window)`` per window.
    After ``cool_down_s`` (doubling on each failed probe up to ``max_cool_down_s``) it lets
    one record through (half-open); success closes it (engine/handlers/breaker.py says why).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = True
    window_s: float = Field(default=30.0, gt=0)
    min_calls: int = Field(default=20, ge=1)
    failure_ratio: float = Field(default=0.5, gt=0.0, le=1.0)
    cool_down_s: float = Field(default=5.0, gt=0)
    max_cool_down_s: float = Field(default=120.0, gt=0)
    retry_budget_ratio: float = Field(default=0.2, ge=0.0, le=1.0)
    retry_budget_min: int = Field(default=20, ge=0)

    @model_validator(mode="after")
    def _cool_downs_ordered(self) -> Self:
        if self.max_cool_down_s < self.cool_down_s:
            raise ValueError(
                "max_cool_down_s (WORKER_BREAKER__MAX_COOL_DOWN_S) must be >= cool_down_s "
                "(WORKER_BREAKER__COOL_DOWN_S)"
            )
        return self
