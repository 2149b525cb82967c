"""FINISH remembers key types across the records of one call (one TYPE for a shared ledger).

What it remembers must stay true while earlier records of the same call change the keys:
a hash emptied by HDEL is gone, a deleted stream may come back as a string. A stale type
would refuse a valid effect (or pass one Redis then refuses half-way through a record).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import fakeredis
import pytest
from reliable_consumer.engine.handlers.context import EffectArg
from reliable_consumer.engine.redis.client import RedisOps
from reliable_consumer.engine.redis.idempotency import FinishRequest, FinishStatus, Idempotency
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.settings import RedisSettings

PREFIX = "unit"
STREAM = f"{PREFIX}:ledger:purchases"
HASH = f"{PREFIX}:entitlements:u1"


@pytest.fixture
async def idem() -> AsyncIterator[tuple[Idempotency, fakeredis.FakeAsyncRedis]]:
    redis = fakeredis.FakeAsyncRedis()
    try:
        yield Idempotency(RedisOps(redis, RedisSettings()), RedisKeys(PREFIX), ttl_s=None,
                          lease_ms=60_000), redis  # fmt: skip
    finally:
        await redis.aclose()


def record(idem: Idempotency, n: int, *effects: tuple[EffectArg, ...]) -> FinishRequest:
    key = idem.key("payments", f"p{n}")
    return FinishRequest(key=key, token=f"T{n}", fingerprint="fp", retry_id="", effects=[*effects])


async def test_key_types_stay_true_across_the_records_of_one_call(
    idem: tuple[Idempotency, fakeredis.FakeAsyncRedis],
) -> None:
    finish, redis = idem
    results = await finish.finish_many(  # one script call: the records share what it knows
        [
            record(finish, 1, ("XADD", STREAM, "*", "n", "1"), ("HSET", HASH, "f", "v")),
            record(finish, 2, ("HDEL", HASH, "f")),  # the hash's last field: the key is gone
            record(finish, 3, ("INCRBY", HASH, 1)),  # so a counter may live there now
            record(finish, 4, ("DEL", STREAM)),
            record(finish, 5, ("SET", STREAM, "text")),
            record(finish, 6, ("XADD", STREAM, "*", "n", "6")),  # a string now: refused
        ]
    )
    statuses = [status for status, _ in results]
    assert statuses == [FinishStatus.OK] * 5 + [FinishStatus.ERROR], results
    assert "WRONGTYPE" in (results[5][1] or "")
    assert await redis.get(HASH) == b"1"
    assert await redis.get(STREAM) == b"text"
