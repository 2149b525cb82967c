"""EXTEND: the leases a record holds are stretched as its handler starts, only while still ours.

On fakeredis (Lua enabled) for speed; tests/integration/test_lease_at_start.py runs the same
script on a real redis-server through the worker's path.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import fakeredis
import pytest
from reliable_consumer.engine.records import Delivery
from reliable_consumer.engine.redis.client import RedisOps
from reliable_consumer.engine.redis.delay_queue import ParkRequest, ParkStatus, RetryQueue
from reliable_consumer.engine.redis.idempotency import (
    ClaimRequest,
    ClaimStatus,
    ExtendRequest,
    ExtendStatus,
    Idempotency,
)
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.settings import RedisSettings


@dataclass
class Env:
    redis: fakeredis.FakeAsyncRedis
    keys: RedisKeys
    idem: Idempotency
    queue: RetryQueue

    async def running_retry(self, lease_ms: int = 500) -> Delivery:
        """A parked record, claimed from the delay queue as the scheduler does."""
        d = Delivery("payments", 1, 5, b"k", b"{}", (), 1_000, attempt=2)
        assert await self.queue.park(ParkRequest(d, 0, "", "")) is ParkStatus.PARKED
        (run,) = await self.queue.claim_due(lease_ms=lease_ms, limit=1)
        return run

    async def inflight(self, run: Delivery) -> float | None:
        score = await self.redis.zscore(self.keys.retry_inflight, run.retry_id)
        return None if score is None else float(score)


@pytest.fixture
async def env() -> AsyncIterator[Env]:
    redis = fakeredis.FakeAsyncRedis()
    ops = RedisOps(redis, RedisSettings())
    keys = RedisKeys("unit")
    try:
        yield Env(
            redis, keys, Idempotency(ops, keys, ttl_s=3600, lease_ms=100), RetryQueue(ops, keys)
        )
    finally:
        await redis.aclose()


def extend(key: str, token: str, run: Delivery | None, ms: int = 5_000) -> ExtendRequest:
    return ExtendRequest(
        key=key,
        token=token,
        claim_ms=ms,
        retry_id=run.retry_id if run else "",
        retry_lease=run.retry_lease if run else None,
        retry_ms=ms,
    )


async def test_extend_stretches_the_claim_and_moves_the_retry_lease_parks_fence_with_it(
    env: Env,
) -> None:
    run = await env.running_retry()
    key = env.idem.key("payments", "p1")
    assert await env.idem.claim(ClaimRequest(key, "R", "fp", False)) is ClaimStatus.CLAIMED
    assert 0 < await env.redis.pttl(key) <= 100

    ((status, lease),) = await env.idem.extend_many([extend(key, "R", run)])

    assert status is ExtendStatus.OK and lease is not None and run.retry_lease is not None
    assert lease >= run.retry_lease + 4_000
    assert await env.redis.pttl(key) > 4_000
    assert await env.inflight(run) == lease
    stale = ParkRequest(replace(run, attempt=3), 0, key, "R")
    assert await env.queue.park(stale) is ParkStatus.LOST_LEASE, "the old token no longer fences"
    current = ParkRequest(replace(run, attempt=3, retry_lease=lease), 0, key, "R")
    assert await env.queue.park(current) is ParkStatus.PARKED


async def test_extend_of_a_fresh_delivery_touches_only_its_claim(env: Env) -> None:
    key = env.idem.key("payments", "p1")
    await env.idem.claim(ClaimRequest(key, "A", "fp", False))
    assert await env.idem.extend_many([extend(key, "A", None)]) == [(ExtendStatus.OK, None)]
    assert await env.redis.pttl(key) > 4_000
    assert await env.redis.zcard(env.keys.retry_inflight) == 0


async def test_extend_never_shortens_a_longer_claim(env: Env) -> None:
    key = env.idem.key("payments", "p1")
    await env.idem.claim(ClaimRequest(key, "A", "fp", False))
    await env.redis.pexpire(key, 60_000)
    assert await env.idem.extend_many([extend(key, "A", None)]) == [(ExtendStatus.OK, None)]
    assert await env.redis.pttl(key) > 50_000


async def test_a_lost_claim_extends_nothing(env: Env) -> None:
    run = await env.running_retry()
    key = env.idem.key("payments", "p1")
    await env.idem.claim(ClaimRequest(key, "other", "fp", False))  # ours expired; theirs now
    ((status, lease),) = await env.idem.extend_many([extend(key, "R", run)])
    assert (status, lease) == (ExtendStatus.LOST_CLAIM, None)
    assert await env.inflight(run) == run.retry_lease, "the retry lease was left alone"
    assert await env.redis.pttl(key) <= 100


async def test_a_reaped_and_reclaimed_retry_lease_is_lost(env: Env) -> None:
    run = await env.running_retry(lease_ms=0)  # ended at once
    assert await env.queue.reap() == 1
    (other,) = await env.queue.claim_due(lease_ms=60_000, limit=1)
    ((status, _),) = await env.idem.extend_many([extend("", "", run)])
    assert status is ExtendStatus.LOST_LEASE
    assert await env.inflight(run) == other.retry_lease


async def test_extend_resent_after_a_lost_reply_recognises_its_own_extension(env: Env) -> None:
    """The reconnect path re-sends a call whose reply was lost: not a lost lease."""
    run = await env.running_retry()
    request = extend("", "", run, ms=60_000)
    ((first, lease),) = await env.idem.extend_many([request])
    ((again, lease_again),) = await env.idem.extend_many([request])
    assert first is again is ExtendStatus.OK
    assert lease is not None and lease_again is not None and lease_again >= lease
    assert await env.inflight(run) == lease_again
