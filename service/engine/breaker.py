"""Circuit breakers: stop feeding a handler whose dependency is down, then probe it.

A handler whose database or payment API is down fails every record with a retryable
error. Parking each one spends its retry policy against an outage and fills the delay
queue; a breaker instead notices the failure rate (or a retry budget spent) and opens,
and the worker holds that handler's records where they are: not run, not parked, not
committed. After a cool-down one record goes through as a probe (half-open); its success
closes the circuit, its failure reopens it for twice as long, up to a cap.

This module is the state machine only, with no I/O: processing asks it what may run and
tells it how runs ended; intake pauses the partitions of open circuits. Counts live in a
ring of fixed time buckets, so memory is O(buckets) whatever the record rate and the
per-record cost is one bucket update. Everything but :meth:`Breaker.snapshot` is meant
for the event loop's thread; the snapshot only reads, so the HTTP threads may call it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from enum import StrEnum
from typing import Any

from service.engine.errors import ConfigurationError
from service.engine.metrics import Metrics
from service.engine.policies import BreakerPolicy
from service.engine.redaction import record_text
from service.engine.registry import Registry
from service.engine.stalls import Stalls

log = logging.getLogger(__name__)

# The window is cut into this many buckets (one per second for 10 s to 600 s windows):
# fine enough that failures leave it smoothly, coarse enough to stay small.
MIN_BUCKETS = 10
MAX_BUCKETS = 600
# The last error in an opening reason: enough to recognise it, short enough for /readyz.
REASON_ERROR_BYTES = 200


class BreakerState(StrEnum):
    CLOSED = "closed"
    HALF_OPEN = "half_open"
    OPEN = "open"


STATE_VALUE = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}
# Module constants: reading ``BreakerState.CLOSED`` costs an enum lookup per record.
_CLOSED, _HALF_OPEN, _OPEN = BreakerState.CLOSED, BreakerState.HALF_OPEN, BreakerState.OPEN

OnChange = Callable[["Breaker", BreakerState, BreakerState], None]


class Breaker:
    """One circuit: a handler's, or a dependency's that several handlers share."""

    __slots__ = (
        "_budget_min",
        "_budget_ratio",
        "_clock",
        "_cool_down_s",
        "_epoch",
        "_event",
        "_failures",
        "_inv_width",
        "_metrics",
        "_min_calls",
        "_n",
        "_on_change",
        "_open_until",
        "_opened_at",
        "_parks",
        "_probe_out",
        "_ratio",
        "_runs",
        "_slot",
        "_stalls",
        "_stamp",
        "_state",
        "_total_failures",
        "_total_parks",
        "_total_runs",
        "held",
        "name",
        "policy",
        "reason",
    )

    def __init__(
        self,
        name: str,
        policy: BreakerPolicy,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_change: OnChange | None = None,
        metrics: Metrics | None = None,
        stalls: Stalls | None = None,
    ) -> None:
        self.name = name
        self.policy = policy
        self.reason = ""
        self.held = 0
        self._clock = clock
        self._on_change = on_change
        self._metrics = metrics
        self._stalls = stalls
        self._state = _CLOSED
        self._cool_down_s = policy.cool_down_s
        # The policy's numbers as plain attributes: a pydantic field read costs more per record.
        self._min_calls = policy.min_calls
        self._ratio = policy.failure_ratio
        self._budget_min = policy.retry_budget_min
        self._budget_ratio = policy.retry_budget_ratio
        self._open_until = 0.0
        self._opened_at = 0.0
        self._probe_out = False
        self._event: asyncio.Event | None = None
        n = min(max(math.ceil(policy.window_s), MIN_BUCKETS), MAX_BUCKETS)
        self._n = n
        self._inv_width = n / policy.window_s
        self._epoch = self._epoch_at(clock())
        self._slot = self._epoch % n
        self._stamp = [self._epoch] * n  # the epoch each slot's counts belong to
        self._runs = [0] * n
        self._failures = [0] * n
        self._parks = [0] * n
        self._total_runs = self._total_failures = self._total_parks = 0
        if metrics is not None:
            metrics.circuit_state.labels(name).set(0)
            metrics.circuit_held.labels(name).set(0)

    # --- the sliding window ---------------------------------------------------------

    def _epoch_at(self, now: float) -> int:
        return math.floor(now * self._inv_width)

    def _slot_now(self) -> int:
        """The current bucket's slot, moving the window first when a bucket has passed."""
        epoch = math.floor(self._clock() * self._inv_width)
        if epoch > self._epoch:
            self._advance(epoch)
        return self._slot

    def _advance(self, epoch: int) -> None:
        """Move the window on to the later ``epoch``, dropping the buckets that left it."""
        n = self._n
        if epoch - self._epoch >= n:
            self._reset_window(epoch)
            return
        runs, failures, parks, stamp = self._runs, self._failures, self._parks, self._stamp
        for e in range(self._epoch + 1, epoch + 1):
            s = e % n
            self._total_runs -= runs[s]
            self._total_failures -= failures[s]
            self._total_parks -= parks[s]
            runs[s] = failures[s] = parks[s] = 0
            stamp[s] = e
        self._epoch = epoch
        self._slot = epoch % n

    def _reset_window(self, epoch: int) -> None:
        n = self._n
        self._stamp[:] = [epoch] * n
        self._runs[:] = [0] * n
        self._failures[:] = [0] * n
        self._parks[:] = [0] * n
        self._total_runs = self._total_failures = self._total_parks = 0
        self._epoch = epoch
        self._slot = epoch % n

    # --- state ----------------------------------------------------------------------

    @property
    def state(self) -> BreakerState:
        """The state now: an OPEN circuit whose cool-down has passed turns HALF_OPEN here."""
        if self._state is _OPEN and self._clock() >= self._open_until:
            self._move(_HALF_OPEN)
        return self._state

    def retry_in_s(self) -> float:
        """Seconds until an OPEN circuit lets a probe through; 0.0 in any other state."""
        if self._state is not _OPEN:
            return 0.0
        return max(0.0, self._open_until - self._clock())

    def record_success(self, runs: int = 1) -> None:
        """A run (or ``runs`` of them) returned, or failed permanently: either way the
        dependency answered. Inline handlers' successes come once per batch."""
        if self._state is _CLOSED:  # the hot path: inlined
            epoch = math.floor(self._clock() * self._inv_width)
            if epoch > self._epoch:
                self._advance(epoch)
            self._runs[self._slot] += runs
            self._total_runs += runs
        elif self.state is _HALF_OPEN:
            self._reset_window(self._epoch_at(self._clock()))
            self._cool_down_s = self.policy.cool_down_s
            self._move(_CLOSED)
        # OPEN: a run admitted before it opened; the probe decides, not this one.

    def record_failure(self, error: str) -> None:
        """A run failed with a retryable error (or timed out)."""
        if self._state is _CLOSED:
            slot = self._slot_now()
            self._runs[slot] += 1
            self._failures[slot] += 1
            self._total_runs += 1
            self._total_failures += 1
            runs, failures = self._total_runs, self._total_failures
            if runs >= self._min_calls and failures >= self._ratio * runs:
                self._open(
                    f"{failures} of {runs} runs failed in the last {self.policy.window_s:g} s: "
                    f"{record_text(error, REASON_ERROR_BYTES)}",
                    self.policy.cool_down_s,
                )
        elif self.state is _HALF_OPEN:
            cool_down = min(self._cool_down_s * 2, self.policy.max_cool_down_s)
            self._open(f"probe failed: {record_text(error, REASON_ERROR_BYTES)}", cool_down)
        # OPEN: already open; failures of runs admitted before it opened change nothing.

    def try_park(self) -> bool:
        """May a retryable failure be parked? False: hold the record instead.

        Counts the park when it fits the retry budget; the park that would exceed it opens
        the circuit, so a slow-burning failure below the ratio cannot fill the delay queue.
        """
        if self._state is not _CLOSED:  # a due half-open is no better: it parks nothing
            return False
        slot = self._slot_now()
        parks = self._total_parks + 1
        if parks > self._budget_min and parks > self._budget_ratio * self._total_runs:
            budget = max(self._budget_min, math.floor(self._budget_ratio * self._total_runs))
            policy = self.policy
            self._open(
                f"retry budget spent: {parks} parks in {policy.window_s:g} s (budget {budget})",
                policy.cool_down_s,
            )
            return False
        self._parks[slot] += 1
        self._total_parks = parks
        return True

    def admit(self, wanted: int) -> int:
        """How many of ``wanted`` records may run now (half-open: one probe at a time)."""
        if self._state is _CLOSED:
            return wanted
        if self.state is _OPEN or self._probe_out or wanted <= 0:
            return 0
        self._probe_out = True
        return 1

    def probe_unused(self) -> None:
        """The admitted probe ended without running the handler: another record may probe."""
        if self._probe_out:
            self._probe_out = False
            self._wake()

    async def changed(self, timeout_s: float | None = None) -> None:
        """Return at the next state change, at an OPEN circuit's cool-down end, or timeout.

        A freed probe (:meth:`probe_unused`) wakes waiters too: admission may differ now.
        """
        if self._event is None:
            self._event = asyncio.Event()
        event = self._event
        wait = timeout_s
        if self._state is _OPEN:
            left = self._open_until - self._clock()
            if left <= 0:
                _ = self.state  # the cool-down is over: turn half-open now, waking others
                return
            wait = left if wait is None else min(wait, left)
        if wait is not None and wait <= 0:
            return
        try:
            async with asyncio.timeout(wait):
                await event.wait()
        except TimeoutError:
            pass
        _ = self.state  # if the cool-down just ended, the transition happens (and wakes) here

    def hold(self, n: int) -> None:
        """``n`` more records wait at this gate (negative when they leave it)."""
        self.held += n
        if self._metrics is not None:
            self._metrics.circuit_held.labels(self.name).set(self.held)

    def snapshot(self) -> dict[str, object]:
        """State and counts for /readyz and the CLI; reads only, safe from another thread."""
        state = self._state
        now = self._clock()
        if state is _OPEN and now >= self._open_until:
            state = _HALF_OPEN  # what the next read on the loop will make it
        oldest = self._epoch_at(now) - self._n
        stamp = self._stamp
        live = [s for s in range(self._n) if stamp[s] > oldest]
        return {
            "state": state.value,
            "reason": self.reason,
            "retry_in_s": round(max(0.0, self._open_until - now), 3) if state is _OPEN else 0.0,
            "held": self.held,
            "runs": sum(self._runs[s] for s in live),
            "failures": sum(self._failures[s] for s in live),
            "parks": sum(self._parks[s] for s in live),
        }

    # --- transitions ----------------------------------------------------------------

    def _open(self, reason: str, cool_down_s: float) -> None:
        self.reason = reason
        self._cool_down_s = cool_down_s
        self._open_until = self._clock() + cool_down_s
        self._move(_OPEN)

    def _move(self, to: BreakerState) -> None:
        """The one way the state changes: log, metrics, stalls, waiters, then on_change."""
        before = self._state
        self._state = to
        self._probe_out = False
        now = self._clock()
        extra: dict[str, Any] = {"circuit": self.name, "circuit_state": to.value}
        stall = f"circuit_open:{self.name}"
        if to is _OPEN:
            if before is _CLOSED:
                self._opened_at = now
            log.warning(
                "circuit %s open for %.1f s: %s",
                self.name,
                self._cool_down_s,
                self.reason,
                extra={**extra, "reason": self.reason, "cool_down_s": self._cool_down_s},
            )
            if self._stalls is not None:
                self._stalls.report(stall, self.reason)
        elif to is _HALF_OPEN:
            log.info("circuit %s half-open: one record probes it", self.name, extra=extra)
        else:
            log.warning(
                "circuit %s closed after %.1f s",
                self.name,
                now - self._opened_at,
                extra={**extra, "open_s": round(now - self._opened_at, 3)},
            )
            if self._stalls is not None:
                self._stalls.clear(stall)
        if self._metrics is not None:
            self._metrics.circuit_state.labels(self.name).set(STATE_VALUE[to])
            self._metrics.circuit_transitions.labels(self.name, to.value).inc()
        self._wake()
        if self._on_change is not None:
            self._on_change(self, before, to)

    def _wake(self) -> None:
        event, self._event = self._event, None
        if event is not None:
            event.set()


class Breakers:
    """Every breaker of a worker, found by handler name."""

    def __init__(
        self,
        registry: Registry,
        default: BreakerPolicy,
        *,
        metrics: Metrics | None = None,
        stalls: Stalls | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_change: OnChange | None = None,
    ) -> None:
        # dependency (or handler name) -> (first handler declaring it, its effective policy)
        declared: dict[str, tuple[str, BreakerPolicy | None]] = {}
        self._by_handler: dict[str, Breaker] = {}
        self._by_topic: list[tuple[str, Breaker]] = []
        self._breakers: dict[str, Breaker] = {}
        for topic, h in registry.items():
            policy = None if h.breaker is False else (h.breaker or default)
            circuit = h.dependency or h.name
            if circuit in declared:
                first, first_policy = declared[circuit]
                if first_policy != policy:
                    raise ConfigurationError(
                        f"handlers {first!r} and {h.name!r} share dependency {circuit!r} "
                        "but declare different breakers; give them the same breaker= "
                        "(or none, for the WORKER_BREAKER__* default)"
                    )
            else:
                declared[circuit] = (h.name, policy)
            if policy is None or not policy.enabled:
                continue
            breaker = self._breakers.get(circuit)
            if breaker is None:
                breaker = Breaker(
                    circuit,
                    policy,
                    clock=clock,
                    on_change=on_change,
                    metrics=metrics,
                    stalls=stalls,
                )
                self._breakers[circuit] = breaker
            self._by_handler[h.name] = breaker
            self._by_topic.append((topic, breaker))

    def for_handler(self, name: str) -> Breaker | None:
        return self._by_handler.get(name)

    def open_topics(self) -> set[str]:
        """Topics whose handler's circuit is OPEN now: intake pauses their partitions."""
        return {topic for topic, b in self._by_topic if b.state is _OPEN}

    def all(self) -> list[Breaker]:
        return list(self._breakers.values())

    def snapshot(self) -> dict[str, dict[str, object]]:
        return {name: b.snapshot() for name, b in self._breakers.items()}
