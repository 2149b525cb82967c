"""The record path leaves no cyclic garbage: reference counting frees all a record made.

The worker's collector tuning (``runtime.tune_gc``) makes full collections rare, so a
reference cycle made per record (an exception kept with its traceback's frames, a task or
closure referring to itself, a per-record cache) would hold its memory until one came.
These run records of every fate through the real path (the testing kit on fakeredis) with
the collector off and require that a collection afterwards finds nothing at all.
"""

from __future__ import annotations

import collections
import gc
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from reliable_consumer.testing import HandlerTestKit

from service.handlers.payments import grant_purchase

RECORDS = 10


def payment(i: int) -> dict[str, object]:
    return {
        "payment_id": f"p{i}",
        "user_id": f"u{i % 3}",
        "product_id": "sku_1",
        "amount_minor": 1299,
        "currency": "EUR",
    }


@pytest.fixture
async def kit() -> AsyncIterator[HandlerTestKit]:
    async with HandlerTestKit(grant_purchase, retry={"jitter": 0}) as kit:
        yield kit


async def cyclic_garbage(run: Callable[[], Awaitable[None]]) -> list[str]:
    """What a collection finds after ``run`` with the collector off: the garbage's types."""
    await run()  # once first: what is made once (scripts loaded, caches) is not per record
    gc.collect()
    gc.disable()
    try:
        await run()
        gc.set_debug(gc.DEBUG_SAVEALL)  # keep what the collection finds, to name it
        found = gc.collect()
        kinds = collections.Counter(type(o).__qualname__ for o in gc.garbage)
        return [f"{n} {kind}" for kind, n in kinds.most_common(10)] if found else []
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


async def test_granted_and_duplicate_records_leave_no_cyclic_garbage(kit: HandlerTestKit) -> None:
    sent = 0

    async def grants_and_duplicates() -> None:
        nonlocal sent
        for i in range(sent, sent + RECORDS):
            assert (await kit.send(payment(i), key=f"u{i % 3}")).granted
            assert (await kit.send(payment(i), key=f"u{i % 3}")).duplicate
        sent += RECORDS

    assert await cyclic_garbage(grants_and_duplicates) == []


async def test_dead_lettered_records_leave_no_cyclic_garbage(kit: HandlerTestKit) -> None:
    async def dead_letters() -> None:
        for _ in range(RECORDS):
            assert (await kit.send(b'{"payment_id": "p1"}', key="u1")).dead_lettered
            assert (await kit.send(None, key="u1")).dead_lettered

    assert await cyclic_garbage(dead_letters) == []


async def test_parked_and_retried_records_leave_no_cyclic_garbage(kit: HandlerTestKit) -> None:
    # Redis refuses the grant's HSET (the key holds a string): the record is parked with
    # the refusal's exception; once the key is fixed its retry grants it.
    entitlements = kit.key("entitlements", "u1")
    sent = 0

    async def parked_then_retried() -> None:
        nonlocal sent
        for i in range(sent, sent + RECORDS):
            await kit.redis.set(entitlements, "not a hash")
            parked = await kit.send({**payment(i), "user_id": "u1"}, key="u1")
            assert parked.parked
            await kit.redis.delete(entitlements)
            assert (await kit.retry(parked)).granted
        sent += RECORDS

    assert await cyclic_garbage(parked_then_retried) == []
