"""Late retries go before fresh fetches: the decision (intake.RetryPriority) on a fake clock,
the intake's pauses it drives, and the scheduler's reading of the lateness (CLAIM_DUE on
fakeredis).

The decision: an episode starts when a reading says the oldest due retry is later than the
bound, ends when a reading says it is within half of it, or at the pause limit, after which
fresh records get as long as it lasted before the next episode (so retries cannot starve
them). The real-server behaviour is tests/integration/test_retry_priority.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import fakeredis
import pytest
from aiokafka.structs import TopicPartition
from reliable_consumer.engine.intake import Intake, RetryPriority
from reliable_consumer.engine.kafka.offsets import OffsetTracker
from reliable_consumer.engine.records import Delivery
from reliable_consumer.engine.redis.client import RedisOps
from reliable_consumer.engine.redis.delay_queue import ParkRequest, RetryQueue
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.settings import RetrySettings, Settings


@dataclass
class Clock:
    now: float = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Episodes:
    """What on_change heard: (active, why, paused_s)."""

    seen: list[tuple[bool, str, float]] = field(default_factory=list)

    def __call__(self, active: bool, why: str, paused_s: float) -> None:
        self.seen.append((active, why, paused_s))


def priority(
    after_ms: int | None = 50, max_pause_ms: int = 2_000
) -> tuple[RetryPriority, Clock, Episodes]:
    clock, episodes = Clock(), Episodes()
    return RetryPriority(after_ms, max_pause_ms, clock=clock, on_change=episodes), clock, episodes


def test_a_retry_later_than_the_bound_holds_fresh_fetches_back() -> None:
    decision, _, episodes = priority(after_ms=50)
    decision.observe(50)  # on the bound: not late enough
    assert not decision.active()
    decision.observe(51)
    assert decision.active()
    assert [(a, why) for a, why, _ in episodes.seen] == [(True, "oldest due retry 51 ms late")]


def test_the_priority_ends_once_the_retries_are_within_half_the_bound() -> None:
    decision, clock, episodes = priority(after_ms=100)
    decision.observe(500)
    clock.now += 0.3
    decision.observe(60)  # better, but not on time yet: no flapping at the bound
    assert decision.active()
    clock.now += 0.2
    decision.observe(50)
    assert not decision.active()
    assert episodes.seen[-1] == (False, "retries on time", pytest.approx(0.5))
    assert decision.paused_s == pytest.approx(0.5)
    decision.observe(101)  # late again: fresh records first get as long as they waited
    assert not decision.active()
    clock.now += 0.5
    decision.observe(101)
    assert decision.active()


def test_a_flood_of_late_retries_holds_fresh_records_back_half_the_time_at_most() -> None:
    decision, clock, episodes = priority(after_ms=50, max_pause_ms=2_000)
    active_s = 0.0
    for _ in range(800):  # 100 s of readings, every 125 ms (exact in binary), all late
        decision.observe(10_000)
        clock.now += 0.125
        if decision.active():
            active_s += 0.125
    ends = [why for active, why, _ in episodes.seen if not active]
    assert ends and set(ends) == {"pause limit reached"}
    assert all(paused <= 2.0 for active, _, paused in episodes.seen if not active)
    assert 0.45 * 100 <= active_s <= 0.5 * 100, active_s


def test_the_pause_ends_at_its_limit_with_no_new_reading() -> None:
    """A scheduler that stalls (Redis gone) sends no reading: the intake must not wait on it."""
    decision, clock, episodes = priority(after_ms=50, max_pause_ms=1_000)
    decision.observe(5_000)
    clock.now += 0.999
    assert decision.active()
    clock.now += 0.001
    assert not decision.active()
    clock.now += 10
    assert not decision.active(), "a stale reading started an episode"
    assert [a for a, _, _ in episodes.seen] == [True, False]


@pytest.mark.parametrize("off", [0, None])
def test_the_priority_is_off_with_a_bound_of_0_or_none(off: int | None) -> None:
    decision, _, episodes = priority(after_ms=off)
    decision.observe(10**9)
    assert not decision.active()
    assert not episodes.seen


def test_the_priority_settings_are_validated() -> None:
    assert RetrySettings().priority_after_ms == 50
    with pytest.raises(ValueError, match="priority_after_ms"):
        RetrySettings(priority_after_ms=-1)
    with pytest.raises(ValueError, match="priority_max_pause_ms"):
        RetrySettings(priority_max_pause_ms=0)
    with pytest.raises(ValueError, match="priority_max_pause_ms"):
        RetrySettings(priority_max_pause_ms=600_000)


class FakeConsumer:
    """What apply_backpressure uses of AIOKafkaConsumer; a pause or resume of a partition
    not assigned is refused, as aiokafka refuses it (resuming an unpaused one is no error)."""

    def __init__(self, assigned: set[TopicPartition]) -> None:
        self.assigned = set(assigned)
        self.paused: set[TopicPartition] = set()

    def assignment(self) -> set[TopicPartition]:
        return set(self.assigned)

    def pause(self, *tps: TopicPartition) -> None:
        if not set(tps) <= self.assigned:
            raise AssertionError(f"pause of unassigned {tps}")
        self.paused |= set(tps)

    def resume(self, *tps: TopicPartition) -> None:
        if not set(tps) <= self.assigned:
            raise AssertionError(f"resume of unassigned {tps}")
        self.paused -= set(tps)


def test_the_intake_pauses_every_partition_newly_assigned_ones_too_while_retries_go_first() -> None:
    import asyncio

    from reliable_consumer.engine.observation.http import HealthState

    intake = Intake(Settings(), OffsetTracker(), HealthState(), asyncio.Event(), lambda n: None)
    first, second = TopicPartition("t", 0), TopicPartition("t", 1)
    consumer = FakeConsumer({first})
    intake._consumer = consumer  # type: ignore[assignment]
    first_in = [True]
    intake.retries_first = lambda: first_in[0]
    intake.apply_backpressure()
    assert consumer.paused == {first}
    consumer.assigned.add(second)  # a rebalance gave it a partition meanwhile
    intake.apply_backpressure()
    assert consumer.paused == {first, second}
    first_in[0] = False
    intake.apply_backpressure()
    assert consumer.paused == set()


async def test_the_claim_says_how_late_the_oldest_item_left_due_is() -> None:
    redis = fakeredis.FakeAsyncRedis()
    settings = Settings(redis={"key_prefix": "unit"})
    keys = RedisKeys("unit")
    queue = RetryQueue(RedisOps(redis, settings.redis), keys)
    assert (await queue.claim(lease_ms=60_000, limit=10)).oldest_due_late_ms == 0  # empty
    for offset in range(3):
        delivery = Delivery("t", 0, offset, f"k{offset}".encode(), b"v", (), 1_000, attempt=2)
        await queue.park(ParkRequest(delivery=delivery, delay_ms=0, idem_key="", token=""))
    # Due 5 s ago and 1 s ago, on Redis's clock; the third stays due now.
    seconds, micros = await redis.time()
    now = int(seconds) * 1000 + int(micros) // 1000
    await redis.zadd(keys.retry_due, {"t/0/0": now - 5_000, "t/0/1": now - 1_000})
    measured = await queue.claim(lease_ms=60_000, limit=0)
    assert measured.deliveries == []
    assert 5_000 <= measured.oldest_due_late_ms < 6_000
    claim = await queue.claim(lease_ms=60_000, limit=1)
    assert [d.offset for d in claim.deliveries] == [0]
    assert 1_000 <= claim.oldest_due_late_ms < 2_000  # the next one left due
    assert await queue.claim_due(lease_ms=60_000, limit=10) != []
    assert (await queue.claim(lease_ms=60_000, limit=10)).oldest_due_late_ms == 0
