"""The circuit breaker's state machine: window, budget, cool-down, probes, metrics, stalls.

A fake clock drives time, except where ``changed()`` must wake a real event loop: there a
real short cool-down and ``wait_for`` deadlines keep each test fast and unable to hang.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
from pydantic import BaseModel

from service.engine.breaker import Breaker, Breakers, BreakerState
from service.engine.context import Context
from service.engine.errors import ConfigurationError
from service.engine.metrics import Metrics
from service.engine.policies import BreakerPolicy
from service.engine.registry import Handler, Registry, handler
from service.engine.stalls import Stalls

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
    return Breaker("psp", policy(**kwargs), clock=clock)


def opened(clock: Clock, **kwargs: object) -> Breaker:
    b = make(clock, **kwargs)
    for _ in range(4):
        b.record_failure("psp down")
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
        b.record_failure("timeout")
    assert state_of(b) is BreakerState.CLOSED, "5 failures of 5 runs, but min_calls is 6"
    b.record_failure("connection refused")
    assert state_of(b) is BreakerState.OPEN
    assert b.reason == "6 of 6 runs failed in the last 10 s: connection refused"


def test_stays_closed_below_the_ratio() -> None:
    clock = Clock()
    b = make(clock, failure_ratio=0.5)
    for _ in range(6):
        b.record_success()
    for _ in range(5):
        b.record_failure("x")
    assert state_of(b) is BreakerState.CLOSED, "5 of 11 is under half"
    b.record_failure("x")
    assert state_of(b) is BreakerState.OPEN, "6 of 12 is half"
    assert b.reason.startswith("6 of 12 runs failed")


def test_old_failures_slide_out_of_the_window() -> None:
    clock = Clock()
    b = make(clock, min_calls=4, window_s=10.0)
    for _ in range(3):
        b.record_failure("x")
    clock.now += 11.0  # past the whole window
    b.record_failure("x")
    assert state_of(b) is BreakerState.CLOSED, "the three early failures left the window"
    assert b.snapshot()["failures"] == 1
    for _ in range(3):
        b.record_failure("x")
    assert state_of(b) is BreakerState.OPEN


def test_the_window_slides_bucket_by_bucket() -> None:
    clock = Clock(1000.0)
    b = make(clock, min_calls=100, window_s=10.0)  # 10 buckets of 1 s
    for second in range(10):
        clock.now = 1000.0 + second
        b.record_failure("x")
    assert b.snapshot()["failures"] == 10
    clock.now = 1010.0  # the bucket of second 0 leaves; the others stay
    b.record_success()
    snap = b.snapshot()
    assert (snap["runs"], snap["failures"]) == (10, 9)


def test_buckets_leaving_one_at_a_time_take_their_failures_along() -> None:
    clock = Clock(1000.0)
    b = make(clock, min_calls=4, failure_ratio=0.6, window_s=10.0)
    for _ in range(3):
        b.record_success()
        b.record_failure("x")
    clock.now = 1005.0
    for _ in range(3):
        b.record_success()
    clock.now = 1010.0  # only the first bucket leaves: 1 failure of 4 runs remains
    b.record_failure("x")
    assert state_of(b) is BreakerState.CLOSED
    snap = b.snapshot()
    assert (snap["runs"], snap["failures"]) == (4, 1)


def test_closing_forgets_the_failures_that_opened_it() -> None:
    clock = Clock()
    b = opened(clock, cool_down_s=2.0, window_s=10.0)
    clock.now += 2.0  # the four failures are still inside the window
    assert b.admit(1) == 1
    b.record_success()
    b.record_failure("one more")
    assert state_of(b) is BreakerState.CLOSED, "1 run since closing, under min_calls"


def test_the_reason_bounds_and_redacts_the_error() -> None:
    clock = Clock()
    b = make(clock)
    for _ in range(4):
        b.record_failure("card 4111 1111 1111 1111 refused " + "x" * 5000)
    assert "4111" not in b.reason
    assert len(b.reason.encode()) < 400


# --- the retry budget -------------------------------------------------------------------


def test_retry_budget_opens_it_and_try_park_refuses() -> None:
    clock = Clock()
    # ratio 0.5 of 10 runs = 5 parks per window (more than the minimum 3)
    b = make(clock, min_calls=1000, retry_budget_ratio=0.5, retry_budget_min=3)
    for _ in range(10):
        b.record_success()
    assert all(b.try_park() for _ in range(5))
    assert state_of(b) is BreakerState.CLOSED
    assert b.try_park() is False
    assert state_of(b) is BreakerState.OPEN
    assert b.reason == "retry budget spent: 6 parks in 10 s (budget 5)"
    assert b.try_park() is False, "an open circuit parks nothing"


def test_retry_budget_minimum_applies_with_few_runs() -> None:
    clock = Clock()
    b = make(clock, min_calls=1000, retry_budget_min=3)
    assert [b.try_park() for _ in range(3)] == [True, True, True]
    assert b.try_park() is False
    assert b.reason == "retry budget spent: 4 parks in 10 s (budget 3)"


def test_parks_slide_out_of_the_window_too() -> None:
    clock = Clock()
    b = make(clock, min_calls=1000, retry_budget_min=3, retry_budget_ratio=0.0)
    assert all(b.try_park() for _ in range(3))
    clock.now += 11.0
    assert all(b.try_park() for _ in range(3))
    assert state_of(b) is BreakerState.CLOSED


def test_half_open_parks_nothing() -> None:
    clock = Clock()
    b = opened(clock)
    clock.now += 5.0
    assert state_of(b) is BreakerState.HALF_OPEN
    assert b.try_park() is False


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
    b.record_failure("still down")  # reopens, cool-down doubled to 10 s
    clock.now += 10.0
    assert b.admit(1) == 1
    b.record_success()
    assert state_of(b) is BreakerState.CLOSED
    assert b.admit(7) == 7
    snap = b.snapshot()
    assert (snap["runs"], snap["failures"], snap["parks"]) == (0, 0, 0)
    for _ in range(4):
        b.record_failure("down again")
    assert b.retry_in_s() == pytest.approx(5.0), "the cool-down starts from policy again"


def test_probe_failure_reopens_with_a_doubled_capped_cool_down() -> None:
    clock = Clock()
    b = opened(clock, cool_down_s=5.0, max_cool_down_s=12.0)
    seen = []
    for _ in range(3):
        clock.now += b.retry_in_s()
        assert b.admit(1) == 1
        b.record_failure("503")
        assert state_of(b) is BreakerState.OPEN
        assert b.reason == "probe failed: 503"
        seen.append(b.retry_in_s())
    assert seen == [pytest.approx(10.0), pytest.approx(12.0), pytest.approx(12.0)]


def test_failures_and_successes_while_open_change_nothing() -> None:
    clock = Clock()
    b = opened(clock)
    reason = b.reason
    b.record_failure("late")
    b.record_success()
    assert state_of(b) is BreakerState.OPEN
    assert b.reason == reason
    assert b.retry_in_s() == pytest.approx(5.0)


def test_closed_after_being_open_logs_how_long(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    caplog.set_level(logging.INFO, logger="service.engine.breaker")
    b = opened(clock)
    clock.now += 5.0
    b.admit(1)
    clock.now += 0.5
    b.record_success()
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert lines == [
        (logging.WARNING, f"circuit psp open for 5.0 s: {b.reason}"),
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
        b.record_failure("x")
    clock.now += 5.0
    b.admit(1)
    b.record_failure("x")
    clock.now += 10.0
    b.admit(1)
    b.record_success()
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
    b.record_failure("x")  # opens
    await asyncio.wait_for(asyncio.gather(*waiters), DEADLINE_S)


async def test_changed_returns_when_the_cool_down_ends() -> None:
    b = Breaker("psp", policy(min_calls=1, failure_ratio=1.0, cool_down_s=0.05))
    b.record_failure("x")
    assert state_of(b) is BreakerState.OPEN
    waiters = [asyncio.create_task(b.changed()) for _ in range(2)]
    await asyncio.wait_for(asyncio.gather(*waiters), DEADLINE_S)
    assert b._state is BreakerState.HALF_OPEN, "the wait itself made it half-open"


async def test_changed_wakes_waiters_when_a_probe_is_freed() -> None:
    b = Breaker("psp", policy(min_calls=1, failure_ratio=1.0, cool_down_s=0.05))
    b.record_failure("x")
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
        b.record_failure("x")
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
    b.record_failure("x")
    assert stalls.active()["circuit_open:psp"].detail == "probe failed: x"
    clock.now += 10.0
    b.admit(1)
    b.record_success()
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
        b.record_success()
    for _ in range(3):
        b.record_failure("x")
    b.hold(2)
    clock.now += 2.0
    assert b.snapshot() == {
        "state": "open",
        "reason": "3 of 5 runs failed in the last 10 s: x",
        "retry_in_s": 3.0,
        "held": 2,
        "runs": 5,
        "failures": 3,
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
        psp.record_failure("x")
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
        grants.record_failure("x")
    assert "circuit_open:grants" in stalls.active()
    assert sample(metrics, "worker_circuit_state", {"circuit": "grants"}) == 2


def test_a_worker_with_conflicting_breakers_fails_before_connecting() -> None:
    """Refused when the worker is built (nothing listens on the URLs below), naming both."""
    from service.engine.settings import Settings
    from service.engine.worker import Worker

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
