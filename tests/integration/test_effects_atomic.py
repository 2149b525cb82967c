"""A record's effects apply all together or not at all, on a real Redis.

Redis keeps a script's earlier writes when a later command fails, so FINISH checks
the effects before applying any. Without that, a ledger entry written before a
failing entitlement write stayed behind, and each retry appended another one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from service.idempotency import ClaimRequest, ClaimStatus, FinishRequest, FinishStatus, Idempotency
from service.keys import RedisKeys
from service.redis_client import RedisOps
from service.settings import RedisSettings

LEDGER = "fx:ledger:purchases"


@pytest.fixture
async def idem(redis_url: str) -> AsyncIterator[tuple[Idempotency, aioredis.Redis]]:
    client = aioredis.from_url(redis_url)
    idempotency = Idempotency(
        RedisOps(client, RedisSettings(url=redis_url)), RedisKeys("fx"), ttl_s=600, lease_ms=5000
    )
    try:
        yield idempotency, client
    finally:
        await client.aclose()


async def run_twice(idem: Idempotency, effects: list[tuple[str | int, ...]]) -> list[FinishStatus]:
    """Two runs of one record (the first fails, its retry runs again), as the worker does."""
    key = idem.key("payments", "p1")
    statuses = []
    for token in ("A", "B"):
        claimed = await idem.claim(ClaimRequest(key, token, "fp", False))
        assert claimed in (ClaimStatus.CLAIMED, ClaimStatus.DONE)
        status, _ = await idem.finish(FinishRequest(key, token, "fp", "", list(effects)))
        statuses.append(status)
        await idem.release(key, token)
    return statuses


@pytest.mark.timeout(60)
async def test_wrong_type_effect_applies_nothing(
    idem: tuple[Idempotency, aioredis.Redis],
) -> None:
    idempotency, client = idem
    await client.set("fx:entitlements:u1", "not a hash")
    effects: list[tuple[str | int, ...]] = [
        ("XADD", LEDGER, "*", "payment_id", "p1"),
        ("HSET", "fx:entitlements:u1", "sku", "p1"),
    ]
    assert await run_twice(idempotency, effects) == [FinishStatus.ERROR, FinishStatus.ERROR]
    assert await client.xlen(LEDGER) == 0, "the ledger entry was applied without the rest"
    status, detail = await idempotency.finish(
        FinishRequest(idempotency.key("payments", "p1"), "C", "fp", "", effects)
    )
    assert status is FinishStatus.ERROR and detail and "WRONGTYPE" in detail


@pytest.mark.timeout(60)
async def test_non_integer_counter_applies_nothing(
    idem: tuple[Idempotency, aioredis.Redis],
) -> None:
    idempotency, client = idem
    await client.set("fx:count", "twelve")
    effects: list[tuple[str | int, ...]] = [
        ("XADD", LEDGER, "*", "payment_id", "p1"),
        ("INCRBY", "fx:count", 5),
    ]
    assert await run_twice(idempotency, effects) == [FinishStatus.ERROR, FinishStatus.ERROR]
    assert await client.xlen(LEDGER) == 0


@pytest.mark.timeout(60)
async def test_valid_effects_apply_once(idem: tuple[Idempotency, aioredis.Redis]) -> None:
    idempotency, client = idem
    await client.set("fx:count", "7")
    effects: list[tuple[str | int, ...]] = [
        ("XADD", LEDGER, "*", "payment_id", "p1"),
        ("HSET", "fx:entitlements:u1", "sku", "p1"),
        ("INCRBY", "fx:count", 10**15),
    ]
    assert await run_twice(idempotency, effects) == [FinishStatus.OK, FinishStatus.DONE]
    assert await client.xlen(LEDGER) == 1
    assert await client.get("fx:count") == str(7 + 10**15).encode()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "stored", ["0", "12", "-5", "007", "1e3", " 1", "-0", "9223372036854775807", "1" * 21]
)
async def test_counter_check_agrees_with_redis(
    idem: tuple[Idempotency, aioredis.Redis], stored: str
) -> None:
    """The pre-check refuses exactly the counters Redis's own INCRBY refuses."""
    idempotency, client = idem
    await client.set("fx:probe", stored)
    try:
        await client.incrby("fx:probe", 0)
        redis_accepts = True
    except aioredis.ResponseError:
        redis_accepts = False
    await client.set("fx:count", stored)
    key = idempotency.key("payments", "p1")
    assert await idempotency.claim(ClaimRequest(key, "A", "fp", False)) is ClaimStatus.CLAIMED
    effects: list[tuple[str | int, ...]] = [
        ("XADD", LEDGER, "*", "payment_id", "p1"),
        ("INCRBY", "fx:count", 0),
    ]
    status, detail = await idempotency.finish(FinishRequest(key, "A", "fp", "", effects))
    assert (status is FinishStatus.OK) == redis_accepts, detail
    assert await client.xlen(LEDGER) == (1 if redis_accepts else 0)
