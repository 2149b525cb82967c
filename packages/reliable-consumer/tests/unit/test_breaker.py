"""The circuit breaker's state machine: window, budget, cool-down, probes, metrics, stalls.

A fake clock drives time, except where ``changed()`` must wake a real event loop: there a
real short cool-down and ``wait_for`` deadlines keep each test fast and unable to hang.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
from dataclasses import dataclass

import pytest
from pydantic import BaseModel
from reliable_consumer.engine.errors import ConfigurationError
from reliable_consumer.engine.handlers.breaker import (
    KEYS_PER_BUCKET,
    Breaker,
    Breakers,
    BreakerState,
    Evidence,
    Failure,
)
from reliable_consumer.engine.handlers.context import Context
from reliable_consumer.engine.handlers.policies import BreakerPolicy, RetryPolicy
from reliable_consumer.engine.handlers.registry import Handler, Registry, handler
from reliable_consumer.engine.observation.metrics import Metrics
from reliable_consumer.engine.stalls import Stalls

DEADLINE_S = 2.0  # a wait that should end in milliseconds fails the test instead of hanging


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def policy(**kwargs: object) -> BreakerPolicy:
    base: dict[str, object] = {
        "window_s": 10.0,
        "min_calls": 4,
        "failure_ratio": 0.5,
        "cool_down_s": 5.0,
        "max_cool_down_s": 12.0,
        "retry_budget_ratio": 0.5,
        "retry_budget_min": 3,
    }
    return BreakerPolicy.model_validate(base | kwargs)


def make(clock: Clock, **kwargs: object) -> Breaker:
    return Breaker("psp", policy(**kwargs), clock=clock, wall=clock)


_keys = itertools.count()


def fail(
    b: Breaker,
    error: str = "psp down",
    *,
    key: str | None = None,
    first: bool = True,
    cls: str = "ConnectionError",
    since_ms: int | None = None,
) -> None:
    """A retryable failure of a record (a new key each time unless given): by default a
    first attempt, as a dependency outage fails them."""
    key = key if key is not None else f"k{next(_keys)}"
    b.record_failure(Failure(error, cls, key, first_attempt=first, failing_since_ms=since_ms))


def opened(clock: Clock, **kwargs: object) -> Breaker:
    b = make(clock, **kwargs)
    for _ in range(4):
        fail(b, "psp down")
    assert state_of(b) is BreakerState.OPEN
    return b


def state_of(b: Breaker) -> BreakerState:
    """``b.state`` read afresh (mypy would keep an earlier assert's narrowing of it)."""
    return b.state


def sample(metrics: Metrics, name: str, labels: dict[str, str]) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


# --- opening on the failure ratio -----------------------------------------------------


def test_opens_at_the_ratio_only_once_min_calls_ran() -> None:
    clock = Clock()
    b = make(clock, min_calls=6)
    for _ in range(5):
        fail(b, "timeout")
    assert state_of(b) is BreakerState.CLOSED, "5 failures of 5 runs, but min_calls is 6"
    fail(b, "connection refused")
    assert state_of(b) is BreakerState.OPEN
    assert b.reason == (
        "6 of 6 first attempts failed in the last 10 s, across 6 keys; "
        "error classes ConnectionError 6; last: connection refused"
    )
    assert b.evidence is Evidence.FIRST_ATTEMPTS


def test_stays_closed_below_the_ratio() -> None:
    clock = Clock()
    b = make(clock, failure_ratio=0.5)
    for _ in range(6):
        b.record_success(first_attempt=True)
    for _ in range(5):
        fail(b, "x")
    assert state_of(b) is BreakerState.CLOSED, "5 of 11 is under half"
    fail(b, "x")
    assert state_of(b) is BreakerState.OPEN, "6 of 12 is half"
    assert b.reason.startswith("6 of 12 first attempts failed")


def test_old_failures_slide_out_of_the_window() -> None:
    clock = Clock()
    b = make(clock, min_calls=4, window_s=10.0)
    for _ in range(3):
        fail(b, "x")
    clock.now += 11.0  # past the whole window
    fail(b, "x")
    assert state_of(b) is BreakerState.CLOSED, "the three early failures left the window"
    assert b.snapshot()["failures"] == 1
    for _ in range(3):
        fail(b, "x")
    assert state_of(b) is BreakerState.OPEN


def test_the_window_slides_bucket_by_bucket() -> None:
    clock = Clock(1000.0)
    b = make(clock, min_calls=100, window_s=10.0)  # 10 buckets of 1 s
    for second in range(10):
        clock.now = 1000.0 + second
        fail(b, "x")
    assert b.snapshot()["failures"] == 10
    clock.now = 1010.0  # the bucket of second 0 leaves; the others stay
    b.record_success(first_attempt=True)
    snap = b.snapshot()
    assert (snap["runs"], snap["failures"]) == (10, 9)


def test_buckets_leaving_one_at_a_time_take_their_failures_along() -> None:
    clock = Clock(1000.0)
    b = make(clock, min_calls=4, failure_ratio=0.6, window_s=10.0)
    for _ in range(3):
        b.record_success(first_attempt=True)
        fail(b, "x")
    clock.now = 1005.0
    for _ in range(3):
        b.record_success(first_attempt=True)
    clock.now = 1010.0  # only the first bucket leaves: 1 failure of 4 runs remains
    fail(b, "x")
    assert state_of(b) is BreakerState.CLOSED
    snap = b.snapshot()
    assert (snap["runs"], snap["failures"]) == (4, 1)


def test_closing_forgets_the_failures_that_opened_it() -> None:
    clock = Clock()
    b = opened(clock, cool_down_s=2.0, window_s=10.0)
    clock.now += 2.0  # the four failures are still inside the window
    assert b.admit(1) == 1
    b.record_success(first_attempt=True)
    fail(b, "one more")
    assert state_of(b) is BreakerState.CLOSED, "1 run since closing, under min_calls"


def test_the_reason_bounds_and_redacts_the_error() -> None:
    clock = Clock()
    b = make(clock)
    for _ in range(4):
        fail(b, "card 4111 1111 1111 1111 refused " + "x" * 5000)
    assert "4111" not in b.reason
    assert len(b.reason.encode()) < 400


# --- the retry budget -------------------------------------------------------------------


def test_retry_budget_opens_it_and_try_park_refuses() -> None:
    clock = Clock()
    # ratio 0.5 of 10 runs = 5 parks per window (more than the minimum 3)
    b = make(clock, min_calls=1000, retry_budget_ratio=0.5, retry_budget_min=3)
    for _ in range(10):
        b.record_success(first_attempt=True)
    assert all(b.try_park(new_item=True) for _ in range(5))
    assert state_of(b) is BreakerState.CLOSED
    assert b.try_park(new_item=True) is False
    assert state_of(b) is BreakerState.OPEN
    assert b.reason == (
        "retry budget spent: 6 records newly parked in 10 s "
        "(budget 5; 10 first attempts, 0 of them failed)"
    )
    assert b.evidence is Evidence.RETRY_BUDGET
    assert b.try_park(new_item=True) is False, "an open circuit parks nothing"


def test_retry_budget_minimum_applies_with_few_runs() -> None:
    clock = Clock()
    b = make(clock, min_calls=1000, retry_budget_min=3)
    assert [b.try_park(new_item=True) for _ in range(3)] == [True, True, True]
    assert b.try_park(new_item=True) is False
    assert b.reason == (
        "retry budget spent: 4 records newly parked in 10 s "
        "(budget 3; 0 first attempts, 0 of them failed)"
    )


def test_parks_slide_out_of_the_window_too() -> None:
    clock = Clock()
    b = make(clock, min_calls=1000, retry_budget_min=3, retry_budget_ratio=0.0)
    assert all(b.try_park(new_item=True) for _ in range(3))
    clock.now += 11.0
    assert all(b.try_park(new_item=True) for _ in range(3))
    assert state_of(b) is BreakerState.CLOSED


def test_half_open_parks_nothing() -> None:
    clock = Clock()
    b = opened(clock)
    clock.now += 5.0
    assert state_of(b) is BreakerState.HALF_OPEN
    assert b.try_park(new_item=True) is False


# --- records failing on their own are not an outage -------------------------------------


@dataclass
class MixRun:
    """What a stream of payments, some failing on their own, did to a breaker."""

    failing: int = 0  # records that fail their first K attempts, K fixed per record
    granted: int = 0  # of those, succeeded on a later attempt
    exhausted: int = 0  # of those, failed every attempt the policy allows
    backlog: int = 0  # parked retries left at the end
    worst_ratio: float = 0.0  # the highest failure ratio of all runs in a full window
    worst_retry_ratio: float = 0.0  # ... of the retries' runs alone
    quiet_s: float = 0.0  # how long only retries ran, at the end


def run_mix(b: Breaker, clock: Clock, *, fresh_per_s: int, fresh_for_s: float) -> MixRun:
    """Every 10th record fails its first K attempts (K = 1..10, fixed per record), the rest
    succeed; failures are parked on the retry policy below and run again when due. No
    dependency is down. Then the fresh records stop and only the backlog runs, longer than
    the window, until it has drained."""
    retry = RetryPolicy(base_delay_ms=1_000, max_delay_ms=8_000, max_attempts=8, jitter=0.0)
    assert retry.max_attempts is not None
    due: list[tuple[float, int, int, float]] = []  # (due at, record, attempt, first failed)
    out = MixRun()
    record, step = 0, 0.1
    min_calls = b.policy.min_calls

    def run(rec: int, attempt: int, first_failed: float | None) -> None:
        failures = (rec // 10) % 10 + 1 if rec % 10 == 3 else 0
        if attempt > failures:
            b.record_success(first_attempt=attempt == 1)
            out.granted += failures > 0
            return
        out.failing += attempt == 1
        since = None if first_failed is None else int(first_failed * 1000)
        b.record_failure(
            Failure(
                f"RetryableError: injected transient failure {attempt}/{failures}",
                "RetryableError",
                f"pay_{rec}",
                first_attempt=attempt == 1,
                failing_since_ms=since,
            )
        )
        assert state_of(b) is BreakerState.CLOSED, b.reason
        if attempt >= retry.max_attempts:
            out.exhausted += 1
            return
        assert b.try_park(new_item=attempt == 1), b.reason
        at = clock.now + retry.delay_ms(attempt) / 1000
        heapq.heappush(due, (at, rec, attempt + 1, first_failed or clock.now))

    started = clock.now
    while clock.now - started < fresh_for_s or due:
        clock.now += step
        if clock.now - started < fresh_for_s:
            for _ in range(round(fresh_per_s * step)):
                run(record, 1, None)
                record += 1
        else:
            out.quiet_s += step
        while due and due[0][0] <= clock.now:
            _, rec, attempt, first_failed = heapq.heappop(due)
            run(rec, attempt, first_failed)
        snap = b.snapshot()
        runs, failures = int(str(snap["runs"])), int(str(snap["failures"]))
        retries = runs - int(str(snap["first_attempts"]))
        retry_failures = failures - int(str(snap["first_attempt_failures"]))
        if runs >= min_calls and clock.now - started >= b.policy.window_s:
            out.worst_ratio = max(out.worst_ratio, failures / runs)
        if retries >= min_calls:
            out.worst_retry_ratio = max(out.worst_retry_ratio, retry_failures / retries)
    out.backlog = len(due)
    return out


def test_self_failing_retries_among_succeeding_first_attempts_never_open_the_circuit() -> None:
    """The defect: every run and every park counted alike, so a backlog of records failing
    on their own (nearly every due retry) read as an outage and opened the circuit."""
    clock = Clock()
    seen: list[BreakerState] = []
    b = Breaker(
        "payments",
        BreakerPolicy(),  # the defaults: 30 s window, 20 runs, half failing; budget a fifth
        clock=clock,
        wall=clock,
        on_change=lambda _b, _a, to: seen.append(to),
    )
    mix = run_mix(b, clock, fresh_per_s=20, fresh_for_s=120)
    # The stream is what opened it before: the window's runs, retries above all, failing
    # at more than the failure ratio, and only retries running for longer than a window.
    assert mix.worst_ratio >= b.policy.failure_ratio, mix
    assert mix.worst_retry_ratio >= 0.8, mix
    assert mix.quiet_s > b.policy.window_s, mix
    assert seen == [], b.reason
    assert mix.backlog == 0
    assert mix.failing == 240 and mix.granted + mix.exhausted == mix.failing, mix
    assert mix.exhausted == 72  # K = 8, 9, 10 of every ten failing records


def test_first_attempts_failing_across_keys_open_it_whatever_the_retries_do() -> None:
    clock = Clock()
    b = make(clock, min_calls=4, failure_ratio=0.5)
    for i in range(20):  # retries of self-failing records: failing or not, not the evidence
        fail(b, "card issuer busy", key=f"old{i % 5}", first=False, cls="RetryableError")
        b.record_success(first_attempt=False)
    for _ in range(2):
        b.record_success(first_attempt=True)
    fail(b, "connection refused")
    assert state_of(b) is BreakerState.CLOSED, "3 first attempts are under min_calls"
    fail(b, "connection refused")
    assert state_of(b) is BreakerState.OPEN, "2 of 4 first attempts failed"
    assert b.evidence is Evidence.FIRST_ATTEMPTS
    assert b.reason == (
        "2 of 4 first attempts failed in the last 10 s, across 2 keys; "
        "error classes ConnectionError 2; last: connection refused"
    )


def test_retries_alone_open_it_only_when_nothing_succeeds_across_keys_with_one_class() -> None:
    """No fresh traffic during an outage: only retries run. Every one of them failing, for
    many keys, the same way, is the evidence left; a few records retrying are not."""
    clock = Clock()
    few = make(clock, min_calls=4)
    for i in range(12):
        fail(few, key=f"r{i % 3}", first=False)
    assert state_of(few) is BreakerState.CLOSED, "12 failures, but of 3 records"

    mixed = make(clock, min_calls=4)
    for i, cls in enumerate(["KeyError", "ValueError", "ConnectionError", "TimeoutError"] * 2):
        fail(mixed, key=f"m{i}", first=False, cls=cls)
    assert state_of(mixed) is BreakerState.CLOSED, "8 keys, but no error class in half"

    answered = make(clock, min_calls=4)
    answered.record_success(first_attempt=False)
    for i in range(8):
        fail(answered, key=f"a{i}", first=False)
    assert state_of(answered) is BreakerState.CLOSED, "a retry succeeded in the window"
    clock.now += 11.0  # the success and those failures leave the window
    for i in range(3):
        fail(answered, key=f"b{i}", first=False)
    assert state_of(answered) is BreakerState.CLOSED, "3 failures are under min_calls"
    fail(answered, "psp down", key="b3", first=False)
    assert state_of(answered) is BreakerState.OPEN
    assert answered.evidence is Evidence.NOTHING_SUCCEEDS
    assert answered.reason == (
        "all 4 runs failed in the last 10 s (0 first attempts), across 4 keys; "
        "error classes ConnectionError 4; last: psp down"
    )


def test_failing_keys_are_remembered_up_to_a_bound_per_bucket() -> None:
    """Memory stays O(buckets) at any failure rate; the reason then says "at least"."""
    clock = Clock()
    b = make(clock, min_calls=4)
    b.record_success(first_attempt=False)
    clock.now += 5.0
    for i in range(500):
        fail(b, key=f"many{i}", first=False)
    assert state_of(b) is BreakerState.CLOSED, "a retry succeeded in the window"
    assert max(len(seen.keys) for seen in b._seen if seen is not None) == KEYS_PER_BUCKET
    clock.now += 6.0  # the success leaves the window; the failures stay
    fail(b, key="one more", first=False)
    assert b.evidence is Evidence.NOTHING_SUCCEEDS
    assert "all 501 runs failed" in b.reason and f"across {KEYS_PER_BUCKET + 1}+ keys" in b.reason


def test_the_retry_budget_counts_records_newly_parked_not_retries_parked_again() -> None:
    """A retry parked again replaces its own item: it cannot flood the delay queue."""
    clock = Clock()
    b = make(clock, min_calls=1000, retry_budget_min=3, retry_budget_ratio=0.0)
    assert all(b.try_park(new_item=False) for _ in range(100))
    assert state_of(b) is BreakerState.CLOSED
    assert [b.try_park(new_item=True) for _ in range(4)] == [True, True, True, False]
    assert b.evidence is Evidence.RETRY_BUDGET


def test_a_failed_probe_of_a_record_failing_since_before_the_circuit_opened_lets_another_probe(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Such a record was failing while the dependency answered others: its failure is no
    evidence that the dependency is still down (it spent an attempt; it does not hold the
    circuit open). A record that first failed within the evidence reopens it."""
    caplog.set_level(logging.INFO, logger="reliable_consumer.engine.handlers.breaker")
    clock = Clock(1000.0)
    b = opened(clock, window_s=10.0)  # evidence from 990 s on (wall clock = the fake clock)
    clock.now += 5.0
    assert b.admit(1) == 1
    fail(b, "card issuer busy", first=False, since_ms=980_000)
    assert state_of(b) is BreakerState.HALF_OPEN
    assert "has been failing since before the circuit opened" in caplog.text
    assert b.admit(1) == 1, "another record probes at once"
    fail(b, "psp down", first=False, since_ms=995_000)
    assert state_of(b) is BreakerState.OPEN
    assert b.evidence is Evidence.PROBE
    assert b.retry_in_s() == pytest.approx(10.0), "a real failed probe doubles the cool-down"


# --- open, half-open, probes ------------------------------------------------------------


def test_open_admits_nothing_and_turns_half_open_after_the_cool_down() -> None:
    clock = Clock()
    b = opened(clock)
    assert b.admit(10) == 0
    assert b.retry_in_s() == pytest.approx(5.0)
    clock.now += 4.9
    assert state_of(b) is BreakerState.OPEN
    assert b.retry_in_s() == pytest.approx(0.1)
    clock.now += 0.1
    assert state_of(b) is BreakerState.HALF_OPEN
    assert b.retry_in_s() == 0.0


def test_half_open_admits_one_probe_at_a_time() -> None:
    clock = Clock()
    b = opened(clock)
    clock.now += 5.0
    assert b.admit(0) == 0
    assert b.admit(10) == 1
    assert b.admit(10) == 0, "a probe is out"
    b.probe_unused()
    assert b.admit(3) == 1, "the unused probe freed its place"
    assert b.admit(3) == 0


def test_probe_success_closes_and_resets_window_and_cool_down() -> None:
    clock = Clock()
    b = opened(clock)
    clock.now += 5.0
    assert b.admit(1) == 1
    fail(b, "still down")  # reopens, cool-down doubled to 10 s
    clock.now += 10.0
    assert b.admit(1) == 1
    b.record_success(first_attempt=True)
    assert state_of(b) is BreakerState.CLOSED
    assert b.admit(7) == 7
    snap = b.snapshot()
    assert (snap["runs"], snap["failures"], snap["parks"]) == (0, 0, 0)
    for _ in range(4):
        fail(b, "down again")
    assert b.retry_in_s() == pytest.approx(5.0), "the cool-down starts from policy again"


def test_probe_failure_reopens_with_a_doubled_capped_cool_down() -> None:
    clock = Clock()
    b = opened(clock, cool_down_s=5.0, max_cool_down_s=12.0)
    seen = []
    for _ in range(3):
        clock.now += b.retry_in_s()
        assert b.admit(1) == 1
        fail(b, "503")
        assert state_of(b) is BreakerState.OPEN
        assert b.reason == "probe failed: 503"
        seen.append(b.retry_in_s())
    assert seen == [pytest.approx(10.0), pytest.approx(12.0), pytest.approx(12.0)]


def test_failures_and_successes_while_open_change_nothing() -> None:
    clock = Clock()
    b = opened(clock)
    reason = b.reason
    fail(b, "late")
    b.record_success(first_attempt=True)
    assert state_of(b) is BreakerState.OPEN
    assert b.reason == reason
    assert b.retry_in_s() == pytest.approx(5.0)


def test_closed_after_being_open_logs_how_long(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    caplog.set_level(logging.INFO, logger="reliable_consumer.engine.handlers.breaker")
    b = opened(clock)
    clock.now += 5.0
    b.admit(1)
    clock.now += 0.5
    b.record_success(first_attempt=True)
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert lines == [
        (logging.WARNING, f"circuit psp open for 5.0 s (first_attempts): {b.reason}"),
        (logging.INFO, "circuit psp half-open: one record probes it"),
        (logging.WARNING, "circuit psp closed after 5.5 s"),
    ]
    assert all(getattr(r, "circuit", None) == "psp" for r in caplog.records)


def test_on_change_sees_every_transition_in_order() -> None:
    clock = Clock()
    seen: list[tuple[str, str, str]] = []
    b = Breaker(
        "psp",
        policy(),
        clock=clock,
        on_change=lambda br, a, z: seen.append((br.name, a.value, z.value)),
    )
    for _ in range(4):
        fail(b, "x")
    clock.now += 5.0
    b.admit(1)
    fail(b, "x")
    clock.now += 10.0
    b.admit(1)
    b.record_success(first_attempt=True)
    assert seen == [
        ("psp", "closed", "open"),
        ("psp", "open", "half_open"),
        ("psp", "half_open", "open"),
        ("psp", "open", "half_open"),
        ("psp", "half_open", "closed"),
    ]


# --- waiting for a change ---------------------------------------------------------------


async def test_changed_wakes_every_waiter_on_a_transition() -> None:
    b = Breaker("psp", policy(min_calls=1, failure_ratio=1.0))
    waiters = [asyncio.create_task(b.changed()) for _ in range(3)]
    await asyncio.sleep(0)  # let them start waiting
    assert not any(w.done() for w in waiters)
    fail(b, "x")  # opens
    await asyncio.wait_for(asyncio.gather(*waiters), DEADLINE_S)


async def test_changed_returns_when_the_cool_down_ends() -> None:
    b = Breaker("psp", policy(min_calls=1, failure_ratio=1.0, cool_down_s=0.05))
    fail(b, "x")
    assert state_of(b) is BreakerState.OPEN
    waiters = [asyncio.create_task(b.changed()) for _ in range(2)]
    await asyncio.wait_for(asyncio.gather(*waiters), DEADLINE_S)
    assert b._state is BreakerState.HALF_OPEN, "the wait itself made it half-open"


async def test_changed_wakes_waiters_when_a_probe_is_freed() -> None:
    b = Breaker("psp", policy(min_calls=1, failure_ratio=1.0, cool_down_s=0.05))
    fail(b, "x")
    await asyncio.wait_for(b.changed(), DEADLINE_S)
    assert b.admit(1) == 1
    waiter = asyncio.create_task(b.changed())
    await asyncio.sleep(0)
    assert not waiter.done()
    b.probe_unused()
    await asyncio.wait_for(waiter, DEADLINE_S)
    assert b.admit(1) == 1


async def test_changed_ends_at_its_timeout_without_a_change() -> None:
    b = Breaker("psp", policy())
    await asyncio.wait_for(b.changed(timeout_s=0.01), DEADLINE_S)
    assert state_of(b) is BreakerState.CLOSED


# --- the gauge of held records, metrics and stalls --------------------------------------


def test_metrics_and_stalls_follow_the_transitions() -> None:
    clock = Clock()
    metrics = Metrics()
    stalls = Stalls(metrics)
    b = Breaker("psp", policy(), clock=clock, metrics=metrics, stalls=stalls)
    state = {"circuit": "psp"}
    assert sample(metrics, "worker_circuit_state", state) == 0
    assert sample(metrics, "worker_circuit_held_records", state) == 0

    for _ in range(4):
        fail(b, "x")
    assert sample(metrics, "worker_circuit_state", state) == 2
    assert sample(metrics, "worker_circuit_transitions_total", {**state, "to": "open"}) == 1
    assert "circuit_open:psp" in stalls.active()
    assert sample(metrics, "worker_stalled", {"cause": "circuit_open:psp"}) == 1

    b.hold(3)
    b.hold(2)
    assert b.held == 5
    assert sample(metrics, "worker_circuit_held_records", state) == 5
    b.hold(-5)
    assert sample(metrics, "worker_circuit_held_records", state) == 0

    clock.now += 5.0
    assert state_of(b) is BreakerState.HALF_OPEN
    assert sample(metrics, "worker_circuit_state", state) == 1
    assert "circuit_open:psp" in stalls.active(), "a half-open circuit still holds records"
    b.admit(1)
    fail(b, "x")
    assert stalls.active()["circuit_open:psp"].detail == "probe failed: x"
    clock.now += 10.0
    b.admit(1)
    b.record_success(first_attempt=True)
    assert sample(metrics, "worker_circuit_state", state) == 0
    assert sample(metrics, "worker_circuit_transitions_total", {**state, "to": "open"}) == 2
    assert sample(metrics, "worker_circuit_transitions_total", {**state, "to": "half_open"}) == 2
    assert sample(metrics, "worker_circuit_transitions_total", {**state, "to": "closed"}) == 1
    assert not stalls
    assert sample(metrics, "worker_stalled", {"cause": "circuit_open:psp"}) == 0


def test_snapshot_reads_without_changing_state() -> None:
    clock = Clock()
    seen: list[BreakerState] = []
    b = Breaker("psp", policy(min_calls=5), clock=clock, on_change=lambda _b, _a, z: seen.append(z))
    for _ in range(2):
        b.record_success(first_attempt=True)
    for _ in range(3):
        fail(b, "x")
    b.hold(2)
    clock.now += 2.0
    assert b.snapshot() == {
        "state": "open",
        "reason": "3 of 5 first attempts failed in the last 10 s, across 3 keys; "
        "error classes ConnectionError 3; last: x",
        "evidence": "first_attempts",
        "retry_in_s": 3.0,
        "held": 2,
        "runs": 5,
        "failures": 3,
        "first_attempts": 5,
        "first_attempt_failures": 3,
        "parks": 0,
    }
    clock.now += 3.0
    assert b.snapshot()["state"] == "half_open"
    assert b.snapshot()["retry_in_s"] == 0.0
    assert seen == [BreakerState.OPEN], "a snapshot (an HTTP thread) fires no transition"


# --- Breakers: one per handler or dependency --------------------------------------------


class Thing(BaseModel):
    thing_id: str


def _noop(payload: Thing, ctx: Context) -> None:
    return None


def declare(name: str, **kwargs: object) -> Handler[Thing]:
    return handler(name, model=Thing, dedupe_key="thing_id", **kwargs)(_noop)  # type: ignore[arg-type]


def registry(*handlers: Handler[Thing]) -> Registry:
    return Registry(handlers, {h.name: f"{h.name}.v1" for h in handlers})


def test_each_handler_gets_its_own_breaker_with_the_default_policy() -> None:
    default = policy()
    breakers = Breakers(registry(declare("grants"), declare("refunds")), default)
    grants, refunds = breakers.for_handler("grants"), breakers.for_handler("refunds")
    assert grants is not None and refunds is not None and grants is not refunds
    assert (grants.name, grants.policy) == ("grants", default)
    assert breakers.for_handler("nobody") is None
    assert [b.name for b in breakers.all()] == ["grants", "refunds"]


def test_a_shared_dependency_shares_one_breaker() -> None:
    clock = Clock()
    breakers = Breakers(
        registry(
            declare("grants", dependency="psp"),
            declare("refunds", dependency="psp"),
            declare("emails"),
        ),
        policy(),
        clock=clock,
    )
    psp = breakers.for_handler("grants")
    assert psp is not None and psp is breakers.for_handler("refunds")
    assert psp.name == "psp"
    assert [b.name for b in breakers.all()] == ["psp", "emails"]
    assert breakers.open_topics() == set()
    for _ in range(4):
        fail(psp, "x")
    assert breakers.open_topics() == {"grants.v1", "refunds.v1"}
    assert set(breakers.snapshot()) == {"psp", "emails"}
    assert breakers.snapshot()["psp"]["state"] == "open"
    clock.now += 5.0
    assert breakers.open_topics() == set(), "half-open partitions are fetched again"


def test_a_handler_policy_overrides_the_default() -> None:
    own = policy(min_calls=50)
    breakers = Breakers(registry(declare("grants", breaker=own)), policy())
    grants = breakers.for_handler("grants")
    assert grants is not None and grants.policy is own


def test_conflicting_policies_on_one_dependency_are_refused() -> None:
    handlers = registry(
        declare("grants", dependency="psp", breaker=policy(min_calls=50)),
        declare("refunds", dependency="psp"),
    )
    with pytest.raises(ConfigurationError) as info:
        Breakers(handlers, policy())
    assert "'grants'" in str(info.value) and "'refunds'" in str(info.value)
    assert "'psp'" in str(info.value)


def test_one_dependency_cannot_be_guarded_for_one_handler_only() -> None:
    handlers = registry(
        declare("grants", dependency="psp", breaker=False),
        declare("refunds", dependency="psp"),
    )
    with pytest.raises(ConfigurationError, match="'grants' and 'refunds'"):
        Breakers(handlers, policy())


def test_equal_policies_on_one_dependency_are_accepted() -> None:
    handlers = registry(
        declare("grants", dependency="psp", breaker=policy(min_calls=50)),
        declare("refunds", dependency="psp", breaker=policy(min_calls=50)),
    )
    breakers = Breakers(handlers, policy())
    assert breakers.for_handler("grants") is breakers.for_handler("refunds")


def test_disabled_breakers_are_none() -> None:
    metrics = Metrics()
    breakers = Breakers(
        registry(
            declare("off", breaker=False),
            declare("disabled", breaker=policy(enabled=False)),
            declare("on"),
        ),
        policy(),
        metrics=metrics,
    )
    assert breakers.for_handler("off") is None
    assert breakers.for_handler("disabled") is None
    assert [b.name for b in breakers.all()] == ["on"]
    assert sample(metrics, "worker_circuit_state", {"circuit": "on"}) == 0
    assert sample(metrics, "worker_circuit_state", {"circuit": "off"}) is None
    assert Breakers(registry(declare("on")), policy(enabled=False)).all() == []


def test_breakers_report_to_the_stalls_and_metrics_they_are_given() -> None:
    metrics = Metrics()
    stalls = Stalls(metrics)
    breakers = Breakers(registry(declare("grants")), policy(), metrics=metrics, stalls=stalls)
    grants = breakers.for_handler("grants")
    assert grants is not None
    for _ in range(4):
        fail(grants, "x")
    assert "circuit_open:grants" in stalls.active()
    assert sample(metrics, "worker_circuit_state", {"circuit": "grants"}) == 2


def test_a_worker_with_conflicting_breakers_fails_before_connecting() -> None:
    """Refused when the worker is built (nothing listens on the URLs below), naming both."""
    from reliable_consumer.engine.settings import Settings
    from reliable_consumer.engine.worker import Worker

    handlers = registry(
        declare("grants", dependency="psp", breaker=policy(min_calls=50)),
        declare("refunds", dependency="psp"),
    )
    settings = Settings(
        kafka={"bootstrap_servers": "127.0.0.1:1"},
        redis={"url": "redis://127.0.0.1:1/0"},
        topics={"grants": "grants.v1", "refunds": "refunds.v1"},
    )
    with pytest.raises(ConfigurationError, match="'grants' and 'refunds'"):
        Worker(settings, handlers)
