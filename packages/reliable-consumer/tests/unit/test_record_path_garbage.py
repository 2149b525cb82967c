"""The record path leaves no cyclic garbage: reference counting frees all a record made.

The worker's collector tuning (``runtime.tune_gc``) makes full collections rare, so a
reference cycle made per record (an exception kept with its traceback's frames, a task or
closure referring to itself, a per-record cache) would hold its memory until one came.
These run records of every fate through the real path (the testing kit on fakeredis) with
the collector off and require that a collection afterwards finds nothing at all.

Each measures in a fresh interpreter: in a suite's worker process, what earlier tests left
behind (a thread pool's threads ending, another kit's fakeredis and Lua objects let go)
became garbage inside the measured window now and then, and was counted as the record
path's (one full run found 42 ``Event``s, 90 ``deque``s and fakeredis ``Item``s).
"""

from __future__ import annotations

import asyncio
import collections
import gc
import json
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable

from reliable_consumer.testing import HandlerTestKit

from service.handlers.payments import grant_purchase

RECORDS = 10
FRESH_PROCESS_TIMEOUT_S = 120.0


def payment(i: int) -> dict[str, object]:
    return {
        "payment_id": f"p{i}",
        "user_id": f"u{i % 3}",
        "product_id": "sku_1",
        "amount_minor": 1299,
        "currency": "EUR",
    }


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


async def grants_and_duplicates(kit: HandlerTestKit) -> list[str]:
    sent = 0

    async def run() -> None:
        nonlocal sent
        for i in range(sent, sent + RECORDS):
            assert (await kit.send(payment(i), key=f"u{i % 3}")).granted
            assert (await kit.send(payment(i), key=f"u{i % 3}")).duplicate
        sent += RECORDS

    return await cyclic_garbage(run)


async def dead_letters(kit: HandlerTestKit) -> list[str]:
    async def run() -> None:
        for _ in range(RECORDS):
            assert (await kit.send(b'{"payment_id": "p1"}', key="u1")).dead_lettered
            assert (await kit.send(None, key="u1")).dead_lettered

    return await cyclic_garbage(run)


async def parked_then_retried(kit: HandlerTestKit) -> list[str]:
    # Redis refuses the grant's HSET (the key holds a string): the record is parked with
    # the refusal's exception; once the key is fixed its retry grants it.
    entitlements = kit.key("entitlements", "u1")
    sent = 0

    async def run() -> None:
        nonlocal sent
        for i in range(sent, sent + RECORDS):
            await kit.redis.set(entitlements, "not a hash")
            parked = await kit.send({**payment(i), "user_id": "u1"}, key="u1")
            assert parked.parked
            await kit.redis.delete(entitlements)
            assert (await kit.retry(parked)).granted
        sent += RECORDS

    return await cyclic_garbage(run)


SCENARIOS: dict[str, Callable[[HandlerTestKit], Awaitable[list[str]]]] = {
    "grants_and_duplicates": grants_and_duplicates,
    "dead_letters": dead_letters,
    "parked_then_retried": parked_then_retried,
}


async def _measure(scenario: str) -> list[str]:
    async with HandlerTestKit(grant_purchase, retry={"jitter": 0}) as kit:
        return await SCENARIOS[scenario](kit)


def garbage_in_a_fresh_interpreter(scenario: str) -> list[str]:
    """Run ``scenario`` in a new Python process (this module, on this test's import path)
    and return the garbage types it found."""
    done = subprocess.run(
        [sys.executable, "-c", f"import {__name__} as m; m.main({scenario!r})"],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
        capture_output=True,
        text=True,
        timeout=FRESH_PROCESS_TIMEOUT_S,
    )
    assert done.returncode == 0, f"the measuring process failed:\n{done.stdout}{done.stderr}"
    found: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


def main(scenario: str) -> None:
    """The fresh interpreter's side: measure, print the garbage's types as JSON."""
    print(json.dumps(asyncio.run(_measure(scenario))))


def test_granted_and_duplicate_records_leave_no_cyclic_garbage() -> None:
    assert garbage_in_a_fresh_interpreter("grants_and_duplicates") == []


def test_dead_lettered_records_leave_no_cyclic_garbage() -> None:
    assert garbage_in_a_fresh_interpreter("dead_letters") == []


def test_parked_and_retried_records_leave_no_cyclic_garbage() -> None:
    assert garbage_in_a_fresh_interpreter("parked_then_retried") == []
