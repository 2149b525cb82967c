"""Circuit breakers: stop feeding a handler whose dependency is down, then probe it.

A handler whose database or downstream API is down fails every record with a retryable
error. Parking each one spends its retry policy against an outage and fills the delay
queue; a breaker instead notices the outage and opens, and the worker holds that
handler's records where they are: not run, not parked, not committed. After a cool-down
one record goes through as a probe (half-open); its success closes the circuit, its
failure reopens it for twice as long, up to a cap.

Records that fail for reasons of their own must not look like an outage: nearly every due
retry is such a record, so a backlog of them fails at a high ratio while the dependency
answers everyone else. The evidence is therefore split. A dependency that is down fails
*first attempts* (records that never ran before) across many keys; records failing on
their own show as retries failing while first attempts mostly succeed. So the failure
ratio counts first attempts only; retries count only when nothing at all succeeds in the
window (fresh records, if any, failing too), across ``min_calls`` distinct keys, mostly with
one error class; and the retry budget counts only parks that add an item to the delay
queue (a retry parked again replaces its own). A failed probe whose record was failing
before the evidence that opened the circuit is no evidence either: another record probes.

This module is the state machine only, with no I/O: processing asks it what may run and
tells it how runs ended; intake pauses the partitions of open circuits. Counts live in a
ring of fixed time buckets, so memory is O(buckets) whatever the record rate and the
per-record cost of a success is one bucket update (a failure also notes its key and error
class in its bucket, bounded). Everything but :meth:`Breaker.snapshot` is meant for the
event loop's thread; the snapshot only reads, so the HTTP threads may call it.

This module is long because the evidence rules and the state machine they drive are one
argument: split apart, neither half would say when a circuit opens.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from reliable_consumer.engine.errors import ConfigurationError
from reliable_consumer.engine.handlers.policies import BreakerPolicy
from reliable_consumer.engine.handlers.redaction import record_text
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.observation.metrics import Metrics
from reliable_consumer.engine.stalls import Stalls

log = logging.getLogger(__name__)

# The window is cut into this many buckets (one per second for 10 s to 600 s windows):
# fine enough that failures leave it smoothly, coarse enough to stay small.
MIN_BUCKETS = 10
MAX_BUCKETS = 600
# The last error in an opening reason: enough to recognise it, short enough for /readyz.
REASON_ERROR_BYTES = 200
# Failing keys a bucket remembers (at least min_calls): enough to tell "many keys" from "a
# few records retrying", bounded whatever the failure rate.
KEYS_PER_BUCKET = 64
# Error classes a bucket tells apart; more (a handler raising dynamic types) count as one.
CLASSES_PER_BUCKET = 16
OTHER_CLASSES = "(other classes)"


class BreakerState(StrEnum):
    CLOSED = "closed"
    HALF_OPEN = "half_open"
    OPEN = "open"


class Evidence(StrEnum):
    """What tripped a circuit: named in its log line, its reason and ``snapshot()``."""

    FIRST_ATTEMPTS = "first_attempts"  # the failure ratio of records' first runs
    NOTHING_SUCCEEDS = "nothing_succeeds"  # every run failing, across keys, one error class
    RETRY_BUDGET = "retry_budget"  # too many records newly parked for the first attempts seen
    PROBE = "probe"  # a half-open probe failed


STATE_VALUE = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}
# Module constants: reading ``BreakerState.CLOSED`` costs an enum lookup per record.
_CLOSED, _HALF_OPEN, _OPEN = BreakerState.CLOSED, BreakerState.HALF_OPEN, BreakerState.OPEN

OnChange = Callable[["Breaker", BreakerState, BreakerState], None]


@dataclass(frozen=True, slots=True)
class Failure:
    """One run that failed retryably, as the breaker weighs it."""

    error: str  # its text (bounded and redacted in a reason)
    error_class: str  # the exception's type name: an outage fails many keys the same way
    key: str  # the record's dedupe key (or coordinates): a few records retrying are few keys
    first_attempt: bool  # the record had never run before: outage evidence on its own
    # Wall-clock ms of the record's first failure before this run (None: this is its first).
    # A probe failing since before the circuit's evidence began says nothing new.
    failing_since_ms: int | None = None


class _Seen:
    """One bucket's failures: their error classes and keys, of every run and of first ones."""

    __slots__ = ("classes", "first_classes", "first_keys", "keys")

    def __init__(self) -> None:
        self.classes: Counter[str] = Counter()
        self.first_classes: Counter[str] = Counter()
        self.keys: set[str] = set()
        self.first_keys: set[str] = set()

    def add(self, failure: Failure, keys_cap: int) -> None:
        _count(self.classes, failure.error_class)
        if len(self.keys) < keys_cap:
            self.keys.add(failure.key)
        if failure.first_attempt:
            _count(self.first_classes, failure.error_class)
            if len(self.first_keys) < keys_cap:
                self.first_keys.add(failure.key)


def _count(classes: Counter[str], name: str) -> None:
    if name in classes or len(classes) < CLASSES_PER_BUCKET:
        classes[name] += 1
    else:
        classes[OTHER_CLASSES] += 1


class Breaker:
    """One circuit: a handler's, or a dependency's that several handlers share."""

    __slots__ = (
        "_budget_min",
        "_budget_ratio",
        "_clock",
        "_cool_down_s",
        "_epoch",
        "_event",
        "_evidence_from_ms",
        "_failures",
        "_first",
        "_first_failures",
        "_inv_width",
        "_keys_cap",
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
        "_seen",
        "_slot",
        "_stalls",
        "_stamp",
        "_state",
        "_total_failures",
        "_total_first",
        "_total_first_failures",
        "_total_parks",
        "_total_runs",
        "_wall",
        "evidence",
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
        wall: Callable[[], float] = time.time,
        on_change: OnChange | None = None,
        metrics: Metrics | None = None,
        stalls: Stalls | None = None,
    ) -> None:
        self.name = name
        self.policy = policy
        self.reason = ""
        self.evidence: Evidence | None = None
        self.held = 0
        self._clock = clock
        self._wall = wall  # compared with records' first-failure times (wall-clock ms)
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
        self._keys_cap = max(KEYS_PER_BUCKET, policy.min_calls)
        self._open_until = 0.0
        self._opened_at = 0.0
        self._evidence_from_ms = 0
        self._probe_out = False
        self._event: asyncio.Event | None = None
        n = min(max(math.ceil(policy.window_s), MIN_BUCKETS), MAX_BUCKETS)
        self._n = n
        self._inv_width = n / policy.window_s
        self._epoch = self._epoch_at(clock())
        self._slot = self._epoch % n
        self._stamp = [self._epoch] * n  # the epoch each slot's counts belong to
        self._runs = [0] * n  # every run that ended
        self._failures = [0] * n  # of which failed retryably
        self._first = [0] * n  # runs of records on their first attempt
        self._first_failures = [0] * n  # of which failed retryably
        self._parks = [0] * n  # records newly parked (an item added to the delay queue)
        self._seen: list[_Seen | None] = [None] * n
        self._total_runs = self._total_failures = self._total_parks = 0
        self._total_first = self._total_first_failures = 0
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
        first, first_failures, seen = self._first, self._first_failures, self._seen
        for e in range(self._epoch + 1, epoch + 1):
            s = e % n
            self._total_runs -= runs[s]
            self._total_failures -= failures[s]
            self._total_first -= first[s]
            self._total_first_failures -= first_failures[s]
            self._total_parks -= parks[s]
            runs[s] = failures[s] = first[s] = first_failures[s] = parks[s] = 0
            seen[s] = None
            stamp[s] = e
        self._epoch = epoch
        self._slot = epoch % n

    def _reset_window(self, epoch: int) -> None:
        n = self._n
        self._stamp[:] = [epoch] * n
        for counts in (self._runs, self._failures, self._first, self._first_failures, self._parks):
            counts[:] = [0] * n
        self._seen[:] = [None] * n
        self._total_runs = self._total_failures = self._total_parks = 0
        self._total_first = self._total_first_failures = 0
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

    def record_success(self, runs: int = 1, *, first_attempt: bool) -> None:
        """A run (or ``runs`` of them) returned, or failed permanently: either way the
        dependency answered. ``first_attempt``: of records that never ran before. Inline
        handlers' successes come once per batch."""
        if self._state is _CLOSED:  # the hot path: inlined
            epoch = math.floor(self._clock() * self._inv_width)
            if epoch > self._epoch:
                self._advance(epoch)
            self._runs[self._slot] += runs
            self._total_runs += runs
            if first_attempt:
                self._first[self._slot] += runs
                self._total_first += runs
        elif self.state is _HALF_OPEN:
            self._reset_window(self._epoch_at(self._clock()))
            self._cool_down_s = self.policy.cool_down_s
            self._move(_CLOSED)
        # OPEN: a run admitted before it opened; the probe decides, not this one.

    def record_failure(self, failure: Failure) -> None:
        """A run failed with a retryable error (or timed out)."""
        if self._state is _CLOSED:
            slot = self._slot_now()
            self._runs[slot] += 1
            self._failures[slot] += 1
            self._total_runs += 1
            self._total_failures += 1
            if failure.first_attempt:
                self._first[slot] += 1
                self._first_failures[slot] += 1
                self._total_first += 1
                self._total_first_failures += 1
            seen = self._seen[slot]
            if seen is None:
                seen = self._seen[slot] = _Seen()
            seen.add(failure, self._keys_cap)
            self._judge(failure)
        elif self.state is _HALF_OPEN:
            since = failure.failing_since_ms
            if since is not None and since < self._evidence_from_ms:
                # A record failing since before the outage's evidence began: its failure is
                # its own as likely as the dependency's. It spent an attempt; another probes.
                log.info(
                    "circuit %s: the probe failed, but its record has been failing since "
                    "before the circuit opened; another record probes",
                    self.name,
                    extra={"circuit": self.name, "circuit_state": self._state.value},
                )
                self.probe_unused()
                return
            cool_down = min(self._cool_down_s * 2, self.policy.max_cool_down_s)
            self._open(
                Evidence.PROBE,
                f"probe failed: {_text(failure.error)}",
                cool_down,
            )
        # OPEN: already open; failures of runs admitted before it opened change nothing.

    def _judge(self, failure: Failure) -> None:
        """Open on outage evidence, not on records failing for reasons of their own."""
        ratio, min_calls = self._ratio, self._min_calls
        first, first_failed = self._total_first, self._total_first_failures
        if failure.first_attempt and first >= min_calls and first_failed >= ratio * first:
            classes, keys, capped = self._window_failures(first_only=True)
            self._open(
                Evidence.FIRST_ATTEMPTS,
                f"{first_failed} of {first} first attempts failed in the last "
                f"{self.policy.window_s:g} s, across {_keys(keys, capped)}; "
                f"error classes {_classes(classes)}; last: {_text(failure.error)}",
                self.policy.cool_down_s,
            )
            return
        failed = self._total_failures
        if failed < self._total_runs or failed < min_calls:
            return  # something answered in the window: retries fail on their own
        classes, keys, capped = self._window_failures(first_only=False)
        top = classes.most_common(1)[0][1] if classes else 0
        if keys >= min_calls and top >= ratio * failed:
            self._open(
                Evidence.NOTHING_SUCCEEDS,
                f"all {failed} runs failed in the last {self.policy.window_s:g} s "
                f"({first_failed} first attempts), across {_keys(keys, capped)}; "
                f"error classes {_classes(classes)}; last: {_text(failure.error)}",
                self.policy.cool_down_s,
            )

    def _window_failures(self, *, first_only: bool) -> tuple[Counter[str], int, bool]:
        """(error classes, distinct failing keys, whether a bucket's keys were capped)."""
        classes: Counter[str] = Counter()
        keys: set[str] = set()
        capped = False
        for seen in self._seen:
            if seen is None:
                continue
            bucket_keys = seen.first_keys if first_only else seen.keys
            classes.update(seen.first_classes if first_only else seen.classes)
            keys |= bucket_keys
            capped = capped or len(bucket_keys) >= self._keys_cap
        return classes, len(keys), capped

    def try_park(self, *, new_item: bool) -> bool:
        """May a retryable failure be parked? False: hold the record instead.

        ``new_item``: the record is not in the delay queue yet (a retry parked again
        replaces its own item, so it cannot flood the queue and is not counted). The park
        that would exceed the budget, ``max(retry_budget_min, retry_budget_ratio * first
        attempts)`` per window, opens the circuit: a slow-burning failure of fresh records
        below the ratio cannot fill the delay queue.
        """
        if self._state is not _CLOSED:  # a due half-open is no better: it parks nothing
            return False
        if not new_item:
            return True
        slot = self._slot_now()
        parks = self._total_parks + 1
        first = self._total_first
        if parks > self._budget_min and parks > self._budget_ratio * first:
            budget = max(self._budget_min, math.floor(self._budget_ratio * first))
            policy = self.policy
            self._open(
                Evidence.RETRY_BUDGET,
                f"retry budget spent: {parks} records newly parked in {policy.window_s:g} s "
                f"(budget {budget}; {first} first attempts, "
                f"{self._total_first_failures} of them failed)",
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
        """The admitted probe told nothing (it never ran the handler, or failed on its own):
        another record may probe."""
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
            "evidence": self.evidence.value if self.evidence is not None else None,
            "retry_in_s": round(max(0.0, self._open_until - now), 3) if state is _OPEN else 0.0,
            "held": self.held,
            "runs": sum(self._runs[s] for s in live),
            "failures": sum(self._failures[s] for s in live),
            "first_attempts": sum(self._first[s] for s in live),
            "first_attempt_failures": sum(self._first_failures[s] for s in live),
            "parks": sum(self._parks[s] for s in live),
        }

    # --- transitions ----------------------------------------------------------------

    def _open(self, evidence: Evidence, reason: str, cool_down_s: float) -> None:
        self.evidence = evidence
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
                # Records failing since before this window's evidence began were failing
                # while the dependency answered others: their failed probes prove nothing.
                self._evidence_from_ms = int((self._wall() - self.policy.window_s) * 1000)
            evidence = self.evidence.value if self.evidence is not None else None
            log.warning(
                "circuit %s open for %.1f s (%s): %s",
                self.name,
                self._cool_down_s,
                evidence,
                self.reason,
                extra={
                    **extra,
                    "reason": self.reason,
                    "evidence": evidence,
                    "cool_down_s": self._cool_down_s,
                },
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


def _text(error: str) -> str:
    return record_text(error, REASON_ERROR_BYTES)


def _keys(n: int, capped: bool) -> str:
    """``12 keys``; ``64+ keys`` when a bucket held more failing keys than it remembers."""
    return f"{n}{'+' if capped else ''} {'key' if n == 1 and not capped else 'keys'}"


def _classes(classes: Counter[str]) -> str:
    """The most common error classes and their counts, e.g. ``ConnectError 18, Timeout 2``."""
    top = classes.most_common(3)
    text = ", ".join(f"{name} {count}" for name, count in top)
    return text + (", …" if len(classes) > len(top) else "")


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
        wall: Callable[[], float] = time.time,
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
                    wall=wall,
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
