"""A record's effects apply all together or not at all, on a real Redis.

Redis keeps a script's earlier writes when a later command fails, so FINISH checks
the effects before applying any. Without that, a ledger entry written before a
failing entitlement write stayed behind, and each retry appended another one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import pytest
import redis.asyncio as aioredis
from reliable_consumer.engine.redis.client import RedisOps
from reliable_consumer.engine.redis.errors import RedisRefused
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

LEDGER = "fx:ledger:purchases"
T = TypeVar("T")


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


# --- issue 12, defect 2: FINISH applied a record's effects partly, then retried them ---

INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)


async def ledger_after_each_run(
    idem: Idempotency, client: aioredis.Redis, effects: list[tuple[str | int, ...]], runs: int = 3
) -> list[tuple[FinishStatus, str | None]]:
    """The record's first run and its retries, asserting no ledger entry after any of them."""
    key = idem.key("payments", "p1")
    results = []
    for n in range(runs):
        token = f"T{n}"
        assert await idem.claim(ClaimRequest(key, token, "fp", False)) is ClaimStatus.CLAIMED
        try:
            results.append(await idem.finish(FinishRequest(key, token, "fp", "", list(effects))))
        except aioredis.ResponseError as exc:  # the script itself broke (before the fix)
            results.append((FinishStatus.ERROR, str(exc)))
        await idem.release(key, token)
        assert await client.xlen(LEDGER) == 0, f"run {n + 1} wrote the ledger entry: {results}"
    assert await client.get(key) is None, "no done-marker for effects that did not apply"
    return results


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("setup", "effect"),
    [
        pytest.param({"fx:count": str(INT64_MAX - 2)}, ("INCRBY", "fx:count", 5), id="incrby"),
        pytest.param({"fx:count": str(INT64_MAX)}, ("INCR", "fx:count"), id="incr"),
        pytest.param({"fx:count": str(INT64_MIN + 1)}, ("DECRBY", "fx:count", 2), id="decrby"),
        pytest.param({"fx:count": str(INT64_MIN)}, ("DECR", "fx:count"), id="decr"),
        pytest.param({"fx:count": "5"}, ("INCRBY", "fx:count", INT64_MAX), id="incrby-amount"),
        pytest.param({}, ("INCRBY", "fx:count", "9" * 20), id="incrby-amount-not-int64"),
        pytest.param({"fx:count": "9" * 20}, ("INCRBY", "fx:count", 1), id="stored-not-int64"),
    ],
)
async def test_overflowing_increment_is_never_granted_twice(
    idem: tuple[Idempotency, aioredis.Redis], setup: dict[str, str], effect: tuple[str | int, ...]
) -> None:
    """Defect 2: the ledger entry was written before the counter overflowed, on every retry."""
    idempotency, client = idem
    for key, value in setup.items():
        await client.set(key, value)
    effects: list[tuple[str | int, ...]] = [("XADD", LEDGER, "*", "payment_id", "p1"), effect]
    results = await ledger_after_each_run(idempotency, client, effects)
    assert {status for status, _ in results} == {FinishStatus.ERROR}
    for key, value in setup.items():
        assert await client.get(key) == value.encode(), "the counter was changed"


@pytest.mark.timeout(60)
async def test_overflow_over_two_increments_of_one_record_is_never_granted_twice(
    idem: tuple[Idempotency, aioredis.Redis],
) -> None:
    """Each increment fits alone; the second overflows what the first made."""
    idempotency, client = idem
    await client.set("fx:count", str(INT64_MAX - 10))
    effects: list[tuple[str | int, ...]] = [
        ("INCRBY", "fx:count", 6),
        ("XADD", LEDGER, "*", "payment_id", "p1"),
        ("INCRBY", "fx:count", 6),
    ]
    await ledger_after_each_run(idempotency, client, effects)
    assert await client.get("fx:count") == str(INT64_MAX - 10).encode()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("stored", "amount"),
    [("abc", 1), ("1.5", 1), (" 7", 1), (str(INT64_MAX), 1), (str(INT64_MIN), -1)],
)
async def test_hincrby_on_a_non_integer_or_overflowing_field_is_never_granted_twice(
    idem: tuple[Idempotency, aioredis.Redis], stored: str, amount: int
) -> None:
    idempotency, client = idem
    await client.hset("fx:h", "n", stored)
    effects: list[tuple[str | int, ...]] = [
        ("XADD", LEDGER, "*", "payment_id", "p1"),
        ("HINCRBY", "fx:h", "n", amount),
    ]
    await ledger_after_each_run(idempotency, client, effects)
    assert await client.hget("fx:h", "n") == stored.encode()


@pytest.mark.timeout(60)
async def test_hincrby_on_a_field_set_by_the_same_record_is_never_granted_twice(
    idem: tuple[Idempotency, aioredis.Redis],
) -> None:
    idempotency, client = idem
    effects: list[tuple[str | int, ...]] = [
        ("XADD", LEDGER, "*", "payment_id", "p1"),
        ("HSET", "fx:h", "n", "not a number"),
        ("HINCRBY", "fx:h", "n", 1),
    ]
    await ledger_after_each_run(idempotency, client, effects)
    assert await client.exists("fx:h") == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "effect",
    [
        pytest.param(("HSET", "fx:h"), id="hset-no-field"),
        pytest.param(("HINCRBY", "fx:h", "n"), id="hincrby-no-amount"),
        pytest.param(("INCRBY", "fx:count"), id="incrby-no-amount"),
        pytest.param(("SADD", "fx:s"), id="sadd-no-member"),
        pytest.param(("FOOBAR", "fx:x", "1"), id="unknown-command"),
        pytest.param(("FLUSHALL", "fx:x"), id="not-an-effect"),
        pytest.param(("SADD", "fx:s", *range(9000)), id="more-args-than-lua-unpacks"),
    ],
)
async def test_wrong_arity_or_unknown_effect_is_never_granted_twice(
    idem: tuple[Idempotency, aioredis.Redis], effect: tuple[str | int, ...]
) -> None:
    """Effects built around ctx.effects' checks still never apply partly in FINISH."""
    idempotency, client = idem
    effects: list[tuple[str | int, ...]] = [("XADD", LEDGER, "*", "payment_id", "p1"), effect]
    results = await ledger_after_each_run(idempotency, client, effects)
    assert {status for status, _ in results} == {FinishStatus.ERROR}, results


@pytest.mark.timeout(60)
async def test_non_zero_increments_apply_exactly_once(
    idem: tuple[Idempotency, aioredis.Redis],
) -> None:
    """The pre-check lets through every increment Redis takes, up to the int64 bounds."""
    idempotency, client = idem
    await client.set("fx:up", str(INT64_MAX - 7))
    await client.set("fx:down", str(INT64_MIN + 7))
    await client.hset("fx:h", "n", "-12")
    effects: list[tuple[str | int, ...]] = [
        ("XADD", LEDGER, "*", "payment_id", "p1"),
        ("INCRBY", "fx:up", 3),
        ("INCRBY", "fx:up", 4),  # exactly INT64_MAX
        ("DECRBY", "fx:down", 7),  # exactly INT64_MIN
        ("HINCRBY", "fx:h", "n", 10**18),
        ("HINCRBY", "fx:h", "new", -5),
        ("INCR", "fx:fresh"),
        ("DECRBY", "fx:fresh", -(10**15)),
        ("SET", "fx:later", "41"),
        ("INCR", "fx:later"),
    ]
    assert await run_twice(idempotency, effects) == [FinishStatus.OK, FinishStatus.DONE]
    assert await client.xlen(LEDGER) == 1
    assert await client.get("fx:up") == str(INT64_MAX).encode()
    assert await client.get("fx:down") == str(INT64_MIN).encode()
    assert await client.hget("fx:h", "n") == str(10**18 - 12).encode()
    assert await client.hget("fx:h", "new") == b"-5"
    assert await client.get("fx:fresh") == str(1 + 10**15).encode()
    assert await client.get("fx:later") == b"42"


class OnceOps(RedisOps):
    """RedisOps that sends each call once, so a test sees what the call raised."""

    async def call(self, fn: Callable[[], Awaitable[T]], *, durable: bool = False) -> T:
        return await fn()


@pytest.fixture
async def restricted(
    redis_url: str,
) -> AsyncIterator[tuple[Idempotency, aioredis.Redis]]:
    """Idempotency as an ACL user that may not run HSET: Redis refuses it mid-script."""
    admin = aioredis.from_url(redis_url)
    await admin.execute_command("ACL", "SETUSER", "worker", "on", ">pw", "~*", "+@all", "-hset")
    url = redis_url.replace("redis://", "redis://worker:pw@")
    client = aioredis.from_url(url)
    idempotency = Idempotency(
        OnceOps(client, RedisSettings(url=url)), RedisKeys("fx"), ttl_s=None, lease_ms=5000
    )
    try:
        yield idempotency, admin
    finally:
        await client.aclose()
        await admin.aclose()


@pytest.mark.timeout(60)
async def test_effect_failing_after_another_applied_keeps_the_marker_and_is_partial(
    restricted: tuple[Idempotency, aioredis.Redis],
) -> None:
    """Defect 2: an effect no check can foresee fails after the ledger entry was written.

    The done-marker is written anyway and the record is reported partial (dead-lettered
    by processing), so no retry or redelivery ever writes the ledger entry again.
    """
    idempotency, admin = restricted
    key = idempotency.key("payments", "p1")
    effects: list[tuple[str | int, ...]] = [
        ("XADD", LEDGER, "*", "payment_id", "p1"),
        ("HSET", "fx:entitlements:u1", "sku", "p1"),
    ]
    status, detail = await idempotency.finish(FinishRequest(key, "A", "fp", "", effects))
    assert status is FinishStatus.PARTIAL and detail and detail.startswith("NOPERM"), detail
    assert await admin.xlen(LEDGER) == 1
    # The reply was lost and the same call is re-sent: partial again, nothing re-applied.
    status, _ = await idempotency.finish(FinishRequest(key, "A", "fp", "", effects))
    assert status is FinishStatus.PARTIAL
    # Until a dead letter of it is acknowledged, every delivery is partial (to be
    # dead-lettered): a worker dying before that ack must not leave the record unreported.
    assert await idempotency.claim(ClaimRequest(key, "B", "fp", False)) is ClaimStatus.PARTIAL
    status, _ = await idempotency.finish(FinishRequest(key, "B", "fp", "", effects))
    assert status is FinishStatus.PARTIAL
    await idempotency.mark_dead(DeadRequest(key, "B", "fp", ""))  # the dead letter's ack
    for token in ("C", "D"):  # later redeliveries and retries are duplicates
        assert await idempotency.claim(ClaimRequest(key, token, "fp", False)) is ClaimStatus.DONE
        status, _ = await idempotency.finish(FinishRequest(key, token, "fp", "", effects))
        assert status is FinishStatus.DONE
    assert await admin.xlen(LEDGER) == 1
    assert await admin.ttl(key) == -1, "a done-marker without a TTL by default"


@pytest.mark.timeout(60)
async def test_redis_refusing_the_first_effect_is_raised_not_a_record_failure(
    restricted: tuple[Idempotency, aioredis.Redis],
) -> None:
    """Nothing applied and Redis refused for its own reasons: RedisRefused, key untouched."""
    idempotency, admin = restricted
    key = idempotency.key("payments", "p1")
    assert await idempotency.claim(ClaimRequest(key, "A", "fp", False)) is ClaimStatus.CLAIMED
    claim_ttl = await admin.pttl(key)
    effects: list[tuple[str | int, ...]] = [
        ("HSET", "fx:entitlements:u1", "sku", "p1"),
        ("XADD", LEDGER, "*", "payment_id", "p1"),
    ]
    with pytest.raises(RedisRefused, match="NOPERM"):
        await idempotency.finish(FinishRequest(key, "A", "fp", "", effects))
    assert await admin.xlen(LEDGER) == 0
    assert await admin.get(key) == b"c|A|fp", "the claim is put back as it was"
    assert 0 < await admin.pttl(key) <= claim_ttl


@pytest.mark.timeout(60)
async def test_redis_out_of_memory_is_raised_not_a_record_failure(
    idem: tuple[Idempotency, aioredis.Redis], redis_url: str
) -> None:
    _, client = idem
    once = Idempotency(
        OnceOps(client, RedisSettings(url=redis_url)), RedisKeys("fx"), ttl_s=None, lease_ms=5000
    )
    await client.config_set("maxmemory", "1")
    try:
        with pytest.raises(RedisRefused, match=r"^OOM"):
            await once.finish(
                FinishRequest(
                    once.key("payments", "p1"), "A", "fp", "", [("XADD", LEDGER, "*", "a", "1")]
                )
            )
    finally:
        await client.config_set("maxmemory", "0")
    assert await client.xlen(LEDGER) == 0
    assert await client.get(once.key("payments", "p1")) is None
