"""The retry scheduler's drain waits for a batch whose claim was in flight at stop.

The defect (found by bench/bench_chains.py): ``stop()`` then ``drain()`` snapshotted the
running batches while the loop was still inside ``claim_due``; the batch it then started
was never waited for and ran on after the worker had closed its producer and Redis.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from reliable_consumer.engine.records import Delivery
from reliable_consumer.engine.redis.delay_queue import Claim, RetryScheduler
from reliable_consumer.engine.settings import RetrySettings

RECORD = Delivery("payments", 0, 7, b"k", b"{}", (), 0, retry_lease=1)


class SlowClaimQueue:
    """A delay queue whose claim answers only when the test lets it (after stop)."""

    def __init__(self) -> None:
        self.claiming = asyncio.Event()
        self.answer = asyncio.Event()

    async def reap(self, *, limit: int = 1000) -> int:
        return 0

    async def depth(self) -> tuple[int, int]:
        return 0, 0

    async def due_in_ms(self) -> int | None:
        return None

    async def claim(self, *, lease_ms: int, limit: int) -> Claim:
        self.claiming.set()
        await self.answer.wait()
        return Claim([RECORD], 0)


async def test_drain_waits_for_a_batch_claimed_while_stopping() -> None:
    queue = SlowClaimQueue()
    finished: list[Delivery] = []
    release = asyncio.Event()

    async def process(batch: list[Delivery], give_up: Callable[[], bool]) -> Any:
        await release.wait()  # a batch that takes a moment, like a real one
        finished.extend(batch)

    scheduler = RetryScheduler(queue, process, RetrySettings(), max_in_flight=10)  # type: ignore[arg-type]
    loop = asyncio.create_task(scheduler.run())
    await asyncio.wait_for(queue.claiming.wait(), 5)
    scheduler.stop()
    queue.answer.set()  # the claim returns after stop: its batch still starts
    asyncio.get_running_loop().call_later(0.2, release.set)
    await scheduler.drain(timeout_s=5)
    assert finished == [RECORD], "drain returned before the batch claimed at stop had run"
    await asyncio.wait_for(loop, 5)


async def test_drain_of_a_scheduler_that_never_ran_returns_at_once() -> None:
    async def process(batch: list[Delivery], give_up: Callable[[], bool]) -> Any:
        raise AssertionError("nothing to run")

    scheduler = RetryScheduler(SlowClaimQueue(), process, RetrySettings(), max_in_flight=1)  # type: ignore[arg-type]
    await asyncio.wait_for(scheduler.drain(timeout_s=30), 1)
