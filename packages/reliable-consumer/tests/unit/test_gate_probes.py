"""Which record probes a half-open circuit: the one that has run the fewest times.

The defect (seen as a flaky outage test, a payment granted on its policy's last attempt):
a failed probe counts as an attempt of the record that probed, and the probe went to
whichever record asked first. A retry, due again just after each cool-down, kept winning
it, so a long outage spent that record's attempts (and would dead-letter it) while the
records waiting in memory spent none. Now a candidate yields to any record waiting for
the same breaker, in any partition's pass, that has run fewer times.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import fakeredis
from pydantic import BaseModel
from reliable_consumer.engine.batch.gate import Gate
from reliable_consumer.engine.batch.jobs import Fate, Job
from reliable_consumer.engine.handlers.breaker import Breakers, BreakerState, Failure
from reliable_consumer.engine.handlers.context import Context
from reliable_consumer.engine.handlers.policies import BreakerPolicy
from reliable_consumer.engine.handlers.registry import Handler, Registry, handler
from reliable_consumer.engine.records import Delivery
from reliable_consumer.engine.redis.client import RedisOps
from reliable_consumer.engine.redis.idempotency import Idempotency
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.settings import RedisSettings
from tests.helpers import await_until

DEADLINE_S = 2.0  # a wait that should end in milliseconds fails the test instead of hanging
COOL_DOWN_S = 0.05
PSP_DOWN = Failure("psp down", "ConnectionError", "g-1", first_attempt=True)


class Grant(BaseModel):
    grant_id: str


def _grant(payload: Grant, ctx: Context) -> None:
    return None


GRANTS: Handler[Grant] = handler("grants", model=Grant, dedupe_key="grant_id")(_grant)  # type: ignore[arg-type]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _gate(clock: Callable[[], float] = time.monotonic, cool_down_s: float = COOL_DOWN_S) -> Gate:
    policy = BreakerPolicy(min_calls=1, failure_ratio=1.0, cool_down_s=cool_down_s)
    breakers = Breakers(Registry([GRANTS], {"grants": "grants.v1"}), policy, clock=clock)
    ops = RedisOps(fakeredis.FakeAsyncRedis(), RedisSettings(url="redis://fake"))
    idem = Idempotency(ops, RedisKeys("t"), ttl_s=None, lease_ms=5_000)
    return Gate(breakers, idem, busy_delay_ms=50)


def _job(offset: int, attempt: int, *, retry: bool = False) -> Job:
    delivery = Delivery(
        "grants.v1", 0, offset, b"k", b"{}", (), 0, attempt=attempt,
        retry_lease=1 if retry else None,
    )  # fmt: skip
    return Job(delivery, handler=GRANTS)


async def _half_open(gate: Gate) -> None:
    breaker = gate.breakers.for_handler("grants")
    assert breaker is not None
    breaker.record_failure(PSP_DOWN)
    assert breaker.state is BreakerState.OPEN
    await asyncio.wait_for(breaker.changed(), DEADLINE_S)
    assert breaker.state is BreakerState.HALF_OPEN


async def test_the_probe_is_the_record_that_ran_fewest_times_not_the_first() -> None:
    gate = _gate()
    await _half_open(gate)
    tried, fresh, also_fresh = _job(0, 3), _job(1, 1), _job(2, 1)
    admitted, wait = await gate.admit([tried, fresh, also_fresh], None)
    assert admitted == [fresh] and fresh.probe
    assert wait == [also_fresh, tried]  # offset order among equals, the most tried last


async def test_a_retry_yields_the_probe_to_a_record_waiting_in_another_pass() -> None:
    clock = Clock()  # the waiting pass's timer never ends the cool-down: the test does
    gate = _gate(clock, cool_down_s=60)
    breaker = gate.breakers.for_handler("grants")
    assert breaker is not None
    breaker.record_failure(PSP_DOWN)
    fresh = _job(0, 1)
    waiting = asyncio.create_task(gate.admit([fresh], None))
    await await_until(lambda: breaker.held == 1, DEADLINE_S, interval=0.001)
    clock.now += 61
    # A retry due at the cool-down's end asks first; the waiting pass is woken, not yet run.
    assert breaker.state is BreakerState.HALF_OPEN
    retry = _job(7, 3, retry=True)
    admitted, wait = await gate.admit([retry], None)
    assert (admitted, wait) == ([], [])
    assert retry.fate is Fate.PARK and retry.next_attempt == 3  # back to the queue, no run spent
    admitted, wait = await asyncio.wait_for(waiting, DEADLINE_S)
    assert admitted == [fresh] and fresh.probe and wait == []


async def test_a_probe_failing_since_before_the_circuit_opened_hands_the_probe_on() -> None:
    """A retry failing for its own reasons (since long before the outage's evidence) won the
    probe: its failure must not reopen the circuit and keep the waiting record out."""
    clock = Clock()
    gate = _gate(clock, cool_down_s=60)
    breaker = gate.breakers.for_handler("grants")
    assert breaker is not None
    breaker.record_failure(PSP_DOWN)
    clock.now += 61
    old_failure_ms = int((time.time() - 3600) * 1000)
    retry = _job(7, 2, retry=True)
    admitted, _ = await gate.admit([retry], None)
    assert admitted == [retry] and retry.probe
    fresh = _job(0, 1)
    waiting = asyncio.create_task(gate.admit([fresh], None))
    await await_until(lambda: breaker.held == 1, DEADLINE_S, interval=0.001)
    breaker.record_failure(
        Failure("card issuer busy", "RetryableError", "g-7", False, old_failure_ms)
    )
    assert breaker.state is BreakerState.HALF_OPEN
    admitted, wait = await asyncio.wait_for(waiting, DEADLINE_S)
    assert admitted == [fresh] and fresh.probe and wait == []
    breaker.record_failure(Failure("psp down", "ConnectionError", "g-0", first_attempt=True))
    assert breaker.state is BreakerState.OPEN, "a record failing within the outage reopens it"
