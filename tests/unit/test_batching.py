"""Group commit: concurrent submits coalesce into few flushes, each caller gets its own result."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from service.batching import Batcher, BatcherClosed


class Recorder:
    """A flush function that records its batches and can be held at a gate."""

    def __init__(self, fail_if: int | None = None) -> None:
        self.batches: list[list[int]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.entered = asyncio.Event()
        self.fail_if = fail_if

    async def __call__(self, items: list[int]) -> Sequence[str]:
        self.batches.append(list(items))
        self.entered.set()
        await self.gate.wait()
        if self.fail_if is not None and self.fail_if in items:
            raise ValueError(f"batch with {self.fail_if} failed")
        return [f"r{i}" for i in items]


async def test_concurrent_submits_become_few_flushes() -> None:
    flush = Recorder()
    batcher: Batcher[int, str] = Batcher(flush, max_batch=500)
    try:
        results = await asyncio.gather(*(batcher.submit(i) for i in range(300)))
        assert results == [f"r{i}" for i in range(300)], "each caller gets its own result"
        assert len(flush.batches) <= 3
        assert sorted(i for b in flush.batches for i in b) == list(range(300))
    finally:
        await batcher.close()


async def test_submits_during_a_flush_go_together_in_the_next() -> None:
    flush = Recorder()
    flush.gate.clear()
    batcher: Batcher[int, str] = Batcher(flush, max_batch=500)
    try:
        first = asyncio.ensure_future(batcher.submit(-1))
        await asyncio.wait_for(flush.entered.wait(), 5)
        rest = [asyncio.ensure_future(batcher.submit(i)) for i in range(200)]
        flush.gate.set()
        assert await first == "r-1"
        assert [await f for f in rest] == [f"r{i}" for i in range(200)]
        assert flush.batches[0] == [-1]
        assert len(flush.batches) <= 3, flush.batches
    finally:
        await batcher.close()


async def test_batches_respect_max_batch() -> None:
    flush = Recorder()
    batcher: Batcher[int, str] = Batcher(flush, max_batch=7)
    try:
        results = await asyncio.gather(*(batcher.submit(i) for i in range(50)))
        assert results == [f"r{i}" for i in range(50)]
        assert all(len(b) <= 7 for b in flush.batches)
        assert len(flush.batches) == 8  # ceil(50 / 7)
    finally:
        await batcher.close()


async def test_a_flush_exception_fails_exactly_that_batch() -> None:
    flush = Recorder(fail_if=7)
    batcher: Batcher[int, str] = Batcher(flush, max_batch=5)
    try:
        outcomes = await asyncio.gather(
            *(batcher.submit(i) for i in range(20)), return_exceptions=True
        )
        failing = next(b for b in flush.batches if 7 in b)
        for i, outcome in enumerate(outcomes):
            if i in failing:
                assert isinstance(outcome, ValueError) and "7" in str(outcome)
            else:
                assert outcome == f"r{i}"
        # The batcher keeps working after a failed batch.
        assert await batcher.submit(100) == "r100"
    finally:
        await batcher.close()


async def test_results_are_routed_by_position_not_by_value() -> None:
    async def flush(items: list[str]) -> list[str]:
        return [item.upper() for item in items]

    batcher: Batcher[str, str] = Batcher(flush)
    try:
        words = ["alpha", "beta", "alpha", "gamma"] * 20
        assert await asyncio.gather(*(batcher.submit(w) for w in words)) == [
            w.upper() for w in words
        ]
    finally:
        await batcher.close()


async def test_close_fails_queued_and_running_items() -> None:
    flush = Recorder()
    flush.gate.clear()  # every flush hangs
    batcher: Batcher[int, str] = Batcher(flush, max_batch=1)
    futures = []
    for i in range(10):
        futures.append(asyncio.ensure_future(batcher.submit(i)))
        for _ in range(3):  # let the batcher take what it can take
            await asyncio.sleep(0)
    await asyncio.wait_for(flush.entered.wait(), 5)
    started = sum(len(b) for b in flush.batches)
    assert 1 <= started < 10, "some items are in flight, the rest queued"
    await batcher.close()
    for fut in futures:
        with pytest.raises(BatcherClosed):
            await fut
    assert sum(len(b) for b in flush.batches) == started, "nothing queued ran after close"
    with pytest.raises(BatcherClosed):
        await batcher.submit(99)


async def test_a_cancelled_caller_does_not_break_the_batch() -> None:
    flush = Recorder()
    flush.gate.clear()
    batcher: Batcher[int, str] = Batcher(flush, max_batch=500)
    try:
        first = asyncio.ensure_future(batcher.submit(0))
        await asyncio.wait_for(flush.entered.wait(), 5)
        doomed = asyncio.ensure_future(batcher.submit(1))
        kept = asyncio.ensure_future(batcher.submit(2))
        await asyncio.sleep(0)
        doomed.cancel()
        flush.gate.set()
        assert await first == "r0"
        assert await kept == "r2"
        assert doomed.cancelled()
    finally:
        await batcher.close()
