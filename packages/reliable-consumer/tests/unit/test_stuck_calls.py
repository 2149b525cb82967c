"""Calls given up on because they ignore their cancellation: how they are waited for, kept
after and reported (the postgres waves' side; the handler pool's is test_handler_pool.py)."""

from __future__ import annotations

import asyncio
import logging

import pytest
from reliable_consumer.engine.handlers.stuck_calls import STALL, StuckCalls, within
from reliable_consumer.engine.observation.metrics import Metrics
from reliable_consumer.engine.stalls import Stalls
from tests.helpers import await_until


class Stubborn:
    """Swallows every cancel until released."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.swallowed = 0
        self.started = False

    async def __call__(self) -> str:
        self.started = True
        while not self.release.is_set():
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.swallowed += 1
        return "ended"


async def test_a_call_that_lets_its_cancel_through_ends_within_its_timeout_as_cancelled() -> None:
    call = asyncio.ensure_future(asyncio.Event().wait())
    assert await asyncio.wait_for(within(call, 0.05, 5), 5)
    assert call.cancelled()


async def test_a_call_in_time_is_left_alone() -> None:
    call = asyncio.ensure_future(asyncio.sleep(0.01, result="done"))
    assert await asyncio.wait_for(within(call, 5, 5), 5)
    assert call.result() == "done"


async def test_a_call_that_swallows_its_cancel_is_cancelled_every_tick_then_given_up() -> None:
    stubborn = Stubborn()
    call = asyncio.ensure_future(stubborn())
    try:
        assert not await asyncio.wait_for(within(call, 0.05, 0.3), 5)
        assert not call.done() and stubborn.swallowed > 1
    finally:
        stubborn.release.set()
    assert await asyncio.wait_for(call, 5) == "ended"


async def test_a_cancelled_waiter_gives_its_call_the_grace_then_lets_its_cancel_go_on() -> None:
    stubborn = Stubborn()
    call = asyncio.ensure_future(stubborn())
    waiter = asyncio.ensure_future(within(call, 60, 0.2))
    await await_until(lambda: stubborn.started, 5, message="the call never started")
    waiter.cancel()
    try:
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(waiter, 5)
        assert stubborn.swallowed > 1 and not call.done()
    finally:
        stubborn.release.set()
    await asyncio.wait_for(call, 5)


async def test_abandoned_calls_are_one_stall_episode_a_gauge_and_are_cancelled_till_they_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    metrics = Metrics()
    stalls = Stalls(metrics)
    stuck = StuckCalls(metrics, stalls)
    first, second = Stubborn(), Stubborn()
    tasks = [asyncio.ensure_future(first()), asyncio.ensure_future(second())]
    try:
        stuck.add("psp", tasks[0])
        stuck.add("psp", tasks[1])
        assert len(stuck) == 2
        assert metrics.handler_abandoned.labels("psp")._value.get() == 2
        assert "2 abandoned handler call(s) still run (psp: 2)" in stalls.active()[STALL].detail
        assert metrics.stalled.labels(STALL)._value.get() == 1
        await await_until(lambda: first.swallowed > 1, 5, message="not cancelled again")
        first.release.set()
        await await_until(lambda: len(stuck) == 1, 5, message="an ended call still counted")
        assert STALL in stalls.active()
        second.release.set()
        await await_until(lambda: not stuck, 5, message="an ended call still counted")
    finally:
        first.release.set()
        second.release.set()
        await asyncio.gather(*tasks)
    assert STALL not in stalls.active()
    assert metrics.handler_abandoned.labels("psp")._value.get() == 0
    assert metrics.stalled.labels(STALL)._value.get() == 0
    lines = [r for r in caplog.records if getattr(r, "stall", None) == STALL]
    assert [r.levelname for r in lines] == ["ERROR", "WARNING"], "one episode, one line each"
    assert "leaked task" in lines[0].getMessage()
