"""The runner pool for async handlers: its bound, its deadlines, and how it lets go."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from reliable_consumer.engine.handlers.pool import HandlerPool, PoolClosedError, Slot
from reliable_consumer.engine.handlers.stuck_calls import StuckCalls
from reliable_consumer.engine.observation.metrics import Metrics
from reliable_consumer.engine.stalls import Stalls
from tests.helpers import await_until


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


# --- calls that ignore their cancellation -------------------------------------------------


async def _quick(slot: Slot) -> None:
    with slot.deadline(5):
        await asyncio.sleep(0)


class Stubborn:
    """A call that swallows every cancel inside its deadline until released, then ends as
    told: it returns, raises, or lets the next cancel through."""

    def __init__(self, timeout_s: float = 0.05, ends: str = "returns") -> None:
        self.timeout_s = timeout_s
        self.ends = ends
        self.release = asyncio.Event()
        self.swallowed = 0
        self.running = 0
        self.abandoned: list[str] = []  # what the pool told the call, in order
        self.after: list[str] = []  # what ran past the deadline block (must stay empty)

    async def __call__(self, slot: Slot) -> None:
        try:
            with slot.deadline(
                self.timeout_s, "stubborn", lambda: self.abandoned.append("gave up")
            ):
                self.running += 1
                try:
                    while not self.release.is_set():
                        try:
                            await self.release.wait()
                        except asyncio.CancelledError:
                            self.swallowed += 1
                    if self.ends == "raises":
                        raise RuntimeError("a late failure")
                    if self.ends == "cancelled":
                        await asyncio.Event().wait()  # the next cancel gets through
                finally:
                    self.running -= 1
            self.after.append("succeeded")
        except TimeoutError:
            self.after.append("timed out")
        except RuntimeError:
            self.after.append("failed")


async def test_a_call_that_swallows_its_cancel_is_cancelled_every_tick_then_abandoned() -> None:
    """The defect: the watchdog cancelled a call past its deadline once. A call that absorbed
    that cancel (a broad ``except``, or 3.11's ``asyncio.wait_for``) and awaited on held its
    runner and its caller forever; in a worker, its partition. Now it is cancelled on every
    tick and, past the grace, given up on: its caller hears (here, with no abandon callback,
    as a TimeoutError), and a new runner takes its slot."""
    pool = HandlerPool(1, cancel_grace_s=0.2)
    release = asyncio.Event()
    swallowed = 0

    async def ignores_cancellation(slot: Slot) -> None:
        nonlocal swallowed
        with slot.deadline(0.05):
            while not release.is_set():
                try:
                    await release.wait()
                except asyncio.CancelledError:
                    swallowed += 1

    caller = asyncio.create_task(pool.run([ignores_cancellation], shortest_timeout_s=0.05))
    try:
        done, _ = await asyncio.wait({caller}, timeout=10)
        assert caller in done, f"the pool still waits for a call that swallowed {swallowed} cancels"
        with pytest.raises(TimeoutError, match="ignored its cancellation"):
            caller.result()
        assert swallowed > 1, "cancelled once only, not on every tick"
        await asyncio.wait_for(pool.run([_quick, _quick]), 5)  # its slot was replaced
    finally:
        release.set()
        await asyncio.wait_for(pool.aclose(), 5)


@pytest.mark.parametrize("ends", ["returns", "raises", "cancelled"])
async def test_an_abandoned_calls_fate_is_decided_once_and_its_late_end_changes_nothing(
    ends: str,
) -> None:
    loop_errors: list[dict[str, object]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _, ctx: loop_errors.append(ctx))
    stuck = StuckCalls()
    pool = HandlerPool(2, cancel_grace_s=0.1, stuck=stuck)
    call = Stubborn(ends=ends)
    quick_runs: list[str] = []

    async def quick(slot: Slot) -> None:
        await _quick(slot)
        quick_runs.append("ran")

    try:
        await asyncio.wait_for(pool.run([call, quick], shortest_timeout_s=0.05), 10)
        assert call.abandoned == ["gave up"]
        assert call.running == 1 and len(stuck) == 1, "it still runs, and is counted"
        call.release.set()
        await await_until(lambda: not stuck, 10, message="the abandoned call never ended")
        assert call.running == 0
        assert call.after == [], f"its own ending was taken for its outcome: {call.after}"
        assert call.abandoned == ["gave up"], "its fate was decided again"
        await asyncio.wait_for(pool.run([quick] * 4), 5)
        assert quick_runs == ["ran"] * 5
        assert loop_errors == [], "a runner failed after the pool gave up on its call"
    finally:
        call.release.set()
        await asyncio.wait_for(pool.aclose(), 5)


async def test_abandoned_calls_are_replaced_up_to_the_pools_size_then_it_runs_short_loudly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    metrics = Metrics()
    stalls = Stalls(metrics)
    stuck = StuckCalls(metrics, stalls)
    pool = HandlerPool(2, cancel_grace_s=0.05, stuck=stuck)
    calls = [Stubborn() for _ in range(5)]
    peak = 0

    def alive() -> int:
        nonlocal peak
        now = sum(c.running for c in calls)
        peak = max(peak, now)
        return now

    try:
        # Two at a time on two runners; each pair abandoned and replaced, up to two
        # abandoned (the pool's size). The fifth call waits: no runner may be added.
        waiting = asyncio.create_task(pool.run(calls, shortest_timeout_s=0.05))
        await await_until(lambda: len(stuck) == 4 and alive() == 4, 10, message="not 4 stuck")
        assert stuck.short == 2
        assert metrics.handler_runners_short._value.get() == 2
        assert metrics.handler_abandoned.labels("stubborn")._value.get() == 4
        assert "handler_stuck" in stalls.active()
        assert "2 runner(s) short" in stalls.active()["handler_stuck"].detail
        done, _ = await asyncio.wait({waiting}, timeout=0.3)  # a bounded look, not a wait
        assert not done and calls[4].running == 0, "a fifth task ran beyond the bound"
        # One ends: the pool has room for one runner again, which takes the fifth call.
        calls[0].release.set()
        await await_until(lambda: calls[4].abandoned, 10, message="the fifth call never ran")
        await asyncio.wait_for(waiting, 10)
        for call in calls:
            call.release.set()
        await await_until(lambda: not stuck, 10, message="abandoned calls never ended")
        assert peak <= 4, f"{peak} calls alive at once: more than twice the pool's size"
        assert stuck.short == 0 and "handler_stuck" not in stalls.active()
        assert metrics.handler_abandoned.labels("stubborn")._value.get() == 0
        await asyncio.wait_for(pool.run([_quick] * 4), 5)
    finally:
        for call in calls:
            call.release.set()
        await asyncio.wait_for(pool.aclose(), 5)
    short = [r for r in caplog.records if "reached their bound" in r.getMessage()]
    assert [r.levelname for r in short] == ["ERROR"], "one loud line when the pool runs short"


async def test_closing_the_pool_gives_up_on_a_call_that_ignores_its_cancellation() -> None:
    stuck = StuckCalls()
    pool = HandlerPool(1, cancel_grace_s=0.1, stuck=stuck)
    call = Stubborn(timeout_s=60)  # long before its deadline: only the close cancels it
    caller = asyncio.create_task(pool.run([call]))
    try:
        await await_until(lambda: call.running, 5, message="the call never started")
        await asyncio.wait_for(pool.aclose(), 5)
        with pytest.raises(PoolClosedError):
            await asyncio.wait_for(caller, 5)
        assert call.swallowed > 1 and len(stuck) == 1
    finally:
        call.release.set()
    await await_until(lambda: not stuck, 5, message="the abandoned call never ended")
