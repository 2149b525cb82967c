"""The runner pool for async handlers: its bound, its deadlines, and how it lets go."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from service.engine.handler_pool import HandlerPool, PoolClosedError, Slot


@pytest.fixture
async def pool() -> AsyncIterator[HandlerPool]:
    p = HandlerPool(3)
    yield p
    await p.aclose()


async def test_runs_every_call_and_never_more_than_size_at_once(pool: HandlerPool) -> None:
    running = 0
    peak = 0
    finished: list[int] = []

    def call(n: int) -> Callable[[Slot], Awaitable[None]]:
        async def run(slot: Slot) -> None:
            nonlocal running, peak
            running += 1
            peak = max(peak, running)
            await asyncio.sleep(0.001 * (n % 4))
            running -= 1
            finished.append(n)

        return run

    await asyncio.gather(
        pool.run([call(n) for n in range(20)]),
        pool.run([call(n) for n in range(20, 30)]),
    )
    assert sorted(finished) == list(range(30))
    assert peak == 3


async def test_a_call_past_its_deadline_gets_timeout_error_and_the_runner_lives_on(
    pool: HandlerPool,
) -> None:
    seen: list[str] = []

    async def slow(slot: Slot) -> None:
        try:
            with slot.deadline(0.05):
                await asyncio.Event().wait()
        except TimeoutError:
            seen.append("timeout")

    async def quick(slot: Slot) -> None:
        with slot.deadline(5):
            await asyncio.sleep(0)
        seen.append("quick")

    await asyncio.wait_for(pool.run([slow, slow, slow, quick]), 5)
    assert sorted(seen) == ["quick", "timeout", "timeout", "timeout"]
    # The runners that timed out are usable again, and carry no leftover cancellation.
    await asyncio.wait_for(pool.run([quick] * 6), 5)
    assert seen.count("quick") == 7


async def test_a_call_that_finishes_in_time_is_not_cancelled_later(pool: HandlerPool) -> None:
    ends: list[str] = []

    async def in_time(slot: Slot) -> None:
        with slot.deadline(0.2):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.4)  # past the deadline, but outside it
        ends.append("done")

    await asyncio.wait_for(pool.run([in_time]), 5)
    assert ends == ["done"]


async def test_cancelling_the_caller_cancels_its_calls_only(pool: HandlerPool) -> None:
    started = asyncio.Event()
    cancelled: list[str] = []
    other_done: list[str] = []

    async def blocked(slot: Slot) -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append("blocked")
            raise

    async def other(slot: Slot) -> None:
        await asyncio.sleep(0.05)
        other_done.append("other")

    caller = asyncio.create_task(pool.run([blocked, blocked, blocked, blocked]))
    await asyncio.wait_for(started.wait(), 5)
    neighbour = asyncio.create_task(pool.run([other]))
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    await asyncio.wait_for(neighbour, 5)
    assert cancelled == ["blocked"] * 3  # the fourth never started
    assert other_done == ["other"]


async def test_a_call_that_raises_ends_its_group_with_that_error(pool: HandlerPool) -> None:
    async def boom(slot: Slot) -> None:
        raise RuntimeError("bug")

    async def fine(slot: Slot) -> None:
        await asyncio.sleep(0)

    with pytest.raises(RuntimeError, match="bug"):
        await asyncio.wait_for(pool.run([fine, boom, fine]), 5)
    await asyncio.wait_for(pool.run([fine]), 5)  # the pool still works


async def test_closing_fails_waiting_callers_instead_of_leaving_them_hanging() -> None:
    pool = HandlerPool(1)
    started = asyncio.Event()

    async def blocked(slot: Slot) -> None:
        started.set()
        await asyncio.Event().wait()

    caller = asyncio.create_task(pool.run([blocked, blocked]))
    await asyncio.wait_for(started.wait(), 5)
    await asyncio.wait_for(pool.aclose(), 5)
    with pytest.raises(PoolClosedError):
        await asyncio.wait_for(caller, 5)
    with pytest.raises(PoolClosedError):
        await pool.run([blocked])


def test_a_pool_needs_a_runner() -> None:
    with pytest.raises(ValueError, match="at least one"):
        HandlerPool(0)


async def test_watchdog_exits_while_a_call_awaits_before_its_deadline(pool: HandlerPool) -> None:
    """The defect: a call that awaits something before entering its deadline (the worker
    renews its leases in Redis there) left the watchdog seeing no deadline and no queued
    call, so it ended; the handler that then hung was never cancelled until another
    batch happened to start a watchdog. Seen on CI as a retry that outlived its lease and
    ran a fourth time with max_attempts=3."""
    seen: list[str] = []

    async def renews_then_hangs(slot: Slot) -> None:
        await asyncio.sleep(0.05)  # a Redis round trip: ten of the watchdog's ticks
        try:
            with slot.deadline(0.05):
                await asyncio.Event().wait()
        except TimeoutError:
            seen.append("timeout")

    await asyncio.wait_for(pool.run([renews_then_hangs], shortest_timeout_s=0.05), timeout=5)
    assert seen == ["timeout"]
