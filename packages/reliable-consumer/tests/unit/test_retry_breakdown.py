"""The delay queue's tally by (handler, reason class), kept by the scripts, on fakeredis.

``worker_retry_queue_items`` and ``service status`` read ``RetryQueue.breakdown()``: one
HGETALL of ``{prefix}:retry:counts``, exact only if every script that parks or drops an
item moves its count. These pin each one: PARK (fresh, re-park with another class, a
redelivery of a parked record, a lost lease, a record blocked in its key's chain), FINISH
and MARK_DEAD (re-sent too), and an item parked before the tally existed. The metrics on a
real Redis and worker: tests/integration/test_retry_metrics.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import fakeredis
import pytest
from reliable_consumer.engine.observation.metrics import Metrics
from reliable_consumer.engine.records import Delivery
from reliable_consumer.engine.redis.client import RedisOps
from reliable_consumer.engine.redis.delay_queue import (
    ParkRequest,
    ParkStatus,
    RetryQueue,
    reason_class,
)
from reliable_consumer.engine.redis.idempotency import (
    ClaimRequest,
    ClaimStatus,
    DeadRequest,
    FinishRequest,
    FinishStatus,
    Idempotency,
)
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.settings import RedisSettings

PREFIX = "unit"
TOPIC = "payments"
RETRYABLE = "RetryableError: bank said later"
TIMEOUT = "TimeoutError"


@dataclass
class Env:
    redis: fakeredis.FakeAsyncRedis
    keys: RedisKeys
    idem: Idempotency
    queue: RetryQueue

    async def park(
        self, d: Delivery, *, handler: str = "payments", error: str | None = RETRYABLE
    ) -> ParkStatus:
        return await self.queue.park(
            ParkRequest(
                delivery=replace(d, last_error=error),
                delay_ms=0,
                idem_key="",
                token="",
                handler=handler,
            )
        )

    async def classes(self) -> dict[str, str]:
        raw = await self.redis.hgetall(self.keys.retry_class)
        return {k.decode(): v.decode() for k, v in raw.items()}

    async def raw_counts(self) -> dict[str, int]:
        raw = await self.redis.hgetall(self.keys.retry_counts)
        return {k.decode(): int(v) for k, v in raw.items()}


@pytest.fixture
async def env() -> AsyncIterator[Env]:
    redis = fakeredis.FakeAsyncRedis()
    ops = RedisOps(redis, RedisSettings())
    keys = RedisKeys(PREFIX)
    try:
        yield Env(
            redis, keys, Idempotency(ops, keys, ttl_s=None, lease_ms=60_000), RetryQueue(ops, keys)
        )
    finally:
        await redis.aclose()


def delivery(offset: int, chain: str = "") -> Delivery:
    return Delivery(
        topic=TOPIC,
        partition=0,
        offset=offset,
        key=b"u1",
        value=b"{}",
        headers=(),
        timestamp_ms=1_000,
        chain=chain,
    )


async def claim_one(env: Env) -> Delivery:
    (run,) = await env.queue.claim_due(lease_ms=60_000, limit=1)
    return run


# --- the label ---


@pytest.mark.parametrize(
    ("last_error", "label"),
    [
        ("RetryableError: injected transient failure 1/2", "RetryableError"),
        ("TimeoutError", "TimeoutError"),
        ("busy: key claimed by another delivery", "busy"),
        ("held: circuit payments is open", "held"),
        ("superseded: claim lease expired", "superseded"),
        ("effect failed in Redis: OOM", "effect_failed_in_Redis"),
        (None, "unknown"),
        ("", "unknown"),
        ("the bank is down", "other"),  # no ':' and not a name: free text is no label
        ("E" * 65 + ": long", "other"),
        ('Bad"Label\n: x', "other"),
        ("a|b: pipes split the tally's fields", "other"),
    ],
)
def test_reason_class_is_a_short_name_or_other(last_error: str | None, label: str) -> None:
    assert reason_class(last_error) == label


# --- PARK ---


async def test_park_counts_the_item_under_its_handler_and_class(env: Env) -> None:
    await env.park(delivery(1))
    await env.park(delivery(2))
    await env.park(delivery(3), error=TIMEOUT)
    await env.park(delivery(4), handler="refunds", error="busy: key claimed by another delivery")
    assert await env.queue.breakdown() == {
        ("payments", "RetryableError"): 2,
        ("payments", "TimeoutError"): 1,
        ("refunds", "busy"): 1,
    }
    assert (await env.classes())[f"{TOPIC}/0/3"] == "payments|TimeoutError"


async def test_a_redelivery_of_a_parked_record_is_not_counted_twice(env: Env) -> None:
    d = delivery(1)
    assert await env.park(d) is ParkStatus.PARKED
    assert await env.park(d, error=TIMEOUT) is ParkStatus.EXISTS
    assert await env.queue.breakdown() == {("payments", "RetryableError"): 1}


async def test_re_park_with_another_class_moves_the_count(env: Env) -> None:
    await env.park(delivery(1))
    await env.park(delivery(2))
    run = await claim_one(env)
    again = ParkRequest(
        delivery=replace(run, attempt=3, last_error="TimeoutError: 2 s"),
        delay_ms=60_000,
        idem_key="",
        token="",
        handler="payments",
    )
    assert await env.queue.park(again) is ParkStatus.PARKED
    assert await env.queue.breakdown() == {
        ("payments", "RetryableError"): 1,
        ("payments", "TimeoutError"): 1,
    }
    # Re-parked in the same class: nothing moves.
    run = await claim_one(env)
    same = replace(again, delivery=replace(run, attempt=2, last_error=RETRYABLE))
    assert await env.queue.park(same) is ParkStatus.PARKED
    assert await env.queue.breakdown() == {
        ("payments", "RetryableError"): 1,
        ("payments", "TimeoutError"): 1,
    }


async def test_a_lost_lease_moves_nothing(env: Env) -> None:
    await env.park(delivery(1))
    run = await claim_one(env)
    stale = ParkRequest(
        delivery=replace(run, retry_lease=1, last_error=TIMEOUT),
        delay_ms=0,
        idem_key="",
        token="",
        handler="payments",
    )
    assert await env.queue.park(stale) is ParkStatus.LOST_LEASE
    assert await env.queue.breakdown() == {("payments", "RetryableError"): 1}


async def test_a_record_waiting_in_its_chain_is_blocked_until_it_leaves(env: Env) -> None:
    chain = env.keys.retry_chain(TOPIC, 0, b"u1")
    head, behind = delivery(1, chain), delivery(2, chain)
    assert await env.park(head) is ParkStatus.PARKED
    # Parked behind the head, whatever its own error: "blocked" while it waits.
    assert await env.park(behind, error=TIMEOUT) is ParkStatus.BLOCKED
    assert await env.queue.breakdown() == {
        ("payments", "RetryableError"): 1,
        ("payments", "blocked"): 1,
    }
    run = await claim_one(env)
    key = env.idem.key("payments", "p1")
    assert await env.idem.claim(ClaimRequest(key, "T", "fp")) is ClaimStatus.CLAIMED
    done = FinishRequest(key, "T", "fp", run.retry_id, [], chain)
    assert (await env.idem.finish(done))[0] is FinishStatus.OK
    # The head left; the next is released (due at once) and keeps its class until it runs.
    assert await env.queue.breakdown() == {("payments", "blocked"): 1}
    run = await claim_one(env)
    assert run.offset == 2
    await env.idem.mark_dead(DeadRequest("", "", "", run.retry_id, chain, run.retry_lease))
    assert await env.queue.breakdown() == {}


# --- the ways out ---


async def test_finish_and_mark_dead_drop_the_count_and_its_fields(env: Env) -> None:
    await env.park(delivery(1))
    await env.park(delivery(2))
    first, second = await env.queue.claim_due(lease_ms=60_000, limit=2)
    key = env.idem.key("payments", "p1")
    assert await env.idem.claim(ClaimRequest(key, "T", "fp")) is ClaimStatus.CLAIMED
    done = FinishRequest(key, "T", "fp", first.retry_id, [], "")
    assert (await env.idem.finish(done))[0] is FinishStatus.OK
    assert await env.queue.breakdown() == {("payments", "RetryableError"): 1}
    dead = DeadRequest("", "", "", second.retry_id, retry_lease=second.retry_lease)
    await env.idem.mark_dead(dead)
    assert await env.queue.breakdown() == {}
    # A field at 0 is deleted, not left behind, and the class entries go with the items.
    assert await env.raw_counts() == {}
    assert await env.classes() == {}
    # Re-sent scripts (the reconnect path re-sends whole calls) take nothing more.
    assert (await env.idem.finish(done))[0] is FinishStatus.OK
    await env.idem.mark_dead(dead)
    assert await env.raw_counts() == {}


async def test_counts_never_go_negative(env: Env) -> None:
    """An item parked before the tally existed (no class entry) is simply not counted,
    and its leaving takes nothing from the others."""
    old, new = delivery(1), delivery(2)
    await env.park(old)
    await env.park(new)
    await env.redis.hdel(env.keys.retry_class, old.retry_id)  # as if parked before
    await env.redis.hincrby(env.keys.retry_counts, "payments|RetryableError", -1)
    assert await env.queue.breakdown() == {("payments", "RetryableError"): 1}
    runs = {d.retry_id: d for d in await env.queue.claim_due(lease_ms=60_000, limit=2)}

    def dead(d: Delivery) -> DeadRequest:  # the run's MARK_DEAD, under its lease
        return DeadRequest("", "", "", d.retry_id, retry_lease=runs[d.retry_id].retry_lease)

    await env.idem.mark_dead(dead(old))
    assert await env.queue.breakdown() == {("payments", "RetryableError"): 1}
    # A count already at 0 (e.g. edited by hand) does not go below: the field is deleted.
    await env.redis.hset(env.keys.retry_counts, "payments|RetryableError", 0)
    await env.idem.mark_dead(dead(new))
    assert await env.raw_counts() == {}
    assert await env.queue.breakdown() == {}


# --- what the scheduler reports ---


async def server_ms(env: Env) -> int:
    sec, usec = await env.redis.time()
    return int(sec) * 1000 + int(usec) // 1000


async def test_gauges_read_sizes_breakdown_and_oldest_due_age(env: Env) -> None:
    empty = await env.queue.gauges()
    assert (empty.due, empty.inflight, empty.waiting, empty.breakdown) == (0, 0, 0, {})
    assert empty.oldest_due_age_s == 0
    await env.park(delivery(1))
    # Due in the future: nothing is overdue yet.
    await env.redis.zadd(env.keys.retry_due, {delivery(1).retry_id: await server_ms(env) + 60_000})
    assert (await env.queue.gauges()).oldest_due_age_s == 0
    # Due 30 s ago by Redis's clock.
    await env.redis.zadd(env.keys.retry_due, {delivery(1).retry_id: await server_ms(env) - 30_000})
    # A chain head released at score 0 by an earlier version (no moment recorded): not an age.
    await env.park(delivery(2))
    await env.redis.zadd(env.keys.retry_due, {delivery(2).retry_id: 0})
    gauges = await env.queue.gauges()
    assert 30 <= gauges.oldest_due_age_s < 40
    assert (gauges.due, gauges.inflight, gauges.waiting) == (2, 0, 0)
    assert gauges.breakdown == {("payments", "RetryableError"): 2}


def test_breakdown_series_follow_the_queue() -> None:
    metrics = Metrics()
    metrics.set_retry_breakdown({("payments", "RetryableError"): 2, ("payments", "busy"): 1})
    metrics.set_retry_breakdown({("payments", "RetryableError"): 1})
    samples = {
        (s.labels["handler"], s.labels["reason"]): s.value
        for family in metrics.registry.collect()
        if family.name == "worker_retry_queue_items"
        for s in family.samples
    }
    assert samples == {("payments", "RetryableError"): 1}


def test_end_to_end_skips_records_without_a_timestamp() -> None:
    metrics = Metrics()
    metrics.observe_done("payments", 1_000, 3_500)
    metrics.observe_done("payments", -1, 3_500)  # no timestamp
    metrics.observe_done("payments", 0, 3_500)
    metrics.observe_done("payments", 9_000, 3_500)  # the producer's clock ahead: no negative
    count = metrics.registry.get_sample_value(
        "worker_end_to_end_seconds_count", {"handler": "payments"}
    )
    total = metrics.registry.get_sample_value(
        "worker_end_to_end_seconds_sum", {"handler": "payments"}
    )
    assert (count, total) == (1, 2.5)
