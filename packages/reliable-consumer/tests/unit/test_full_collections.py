"""The backstop full collection runs when the memory grows, or at the ceiling interval.

``runtime.collect_when_memory_grows`` runs one when the process's RSS grew past a bound since
the last, or when the ceiling interval passed (5 s by default, the clock the worker always
had). The clock, the memory reading and the sleep are fakes here: the loop's decisions are
checked step by step.
"""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path

import pytest
from reliable_consumer.engine.runtime import (
    PAGE_BYTES,
    CollectionTrigger,
    FullCollectionTimer,
    Trigger,
    collect_when_memory_grows,
    rss_bytes,
)

MB = 1024 * 1024


def test_growth_past_the_bound_is_due_and_measured_from_the_last_collection() -> None:
    trigger = CollectionTrigger(
        growth_bytes=32 * MB, ceiling_s=60.0, last_at=0.0, base_rss=100 * MB
    )
    assert trigger.due(1.0, 131 * MB) is None
    assert trigger.due(2.0, 132 * MB) == "memory"
    trigger.collected(2.0, 130 * MB)
    # The level after the collection is the new base: staying there asks for nothing.
    assert trigger.due(3.0, 150 * MB) is None
    assert trigger.due(4.0, 162 * MB) == "memory"


def test_flat_memory_waits_for_the_ceiling() -> None:
    trigger = CollectionTrigger(
        growth_bytes=32 * MB, ceiling_s=60.0, last_at=0.0, base_rss=100 * MB
    )
    for second in range(1, 60):
        assert trigger.due(float(second), 100 * MB + second * 100_000) is None, second
    assert trigger.due(60.0, 106 * MB) == "ceiling"
    trigger.collected(60.0, 106 * MB)
    assert trigger.due(119.0, 100 * MB) is None
    assert trigger.due(120.0, 100 * MB) == "ceiling"


def test_memory_that_falls_does_not_ask() -> None:
    trigger = CollectionTrigger(
        growth_bytes=32 * MB, ceiling_s=60.0, last_at=0.0, base_rss=200 * MB
    )
    assert trigger.due(1.0, 120 * MB) is None
    assert trigger.due(2.0, 231 * MB) is None
    assert trigger.due(3.0, 232 * MB) == "memory"


def test_unreadable_memory_leaves_the_ceiling() -> None:
    trigger = CollectionTrigger(growth_bytes=1, ceiling_s=10.0, last_at=0.0, base_rss=None)
    assert trigger.due(1.0, None) is None
    assert trigger.due(9.0, None) is None
    assert trigger.due(10.0, None) == "ceiling"
    # A first reading becomes the base, not a growth.
    trigger.collected(10.0, None)
    assert trigger.due(11.0, 500 * MB) is None
    assert trigger.due(12.0, 500 * MB + 1) == "memory"


def test_rss_is_read_from_statm(tmp_path: Path) -> None:
    statm = tmp_path / "statm"
    statm.write_text("9000 2500 300 10 0 700 0\n")
    assert rss_bytes(statm) == 2500 * PAGE_BYTES
    assert rss_bytes(tmp_path / "missing") is None
    statm.write_text("")
    assert rss_bytes(statm) is None


class FakeProcess:
    """A clock that the loop's sleep advances, an RSS the test sets, and the collections."""

    def __init__(self, rss: int, steps: int) -> None:
        self.now = 0.0
        self.rss = rss
        self.steps = steps
        self.collected: list[tuple[float, Trigger]] = []
        self.planned: dict[float, int] = {}  # at this time, the RSS becomes this

    def clock(self) -> float:
        return self.now

    def read_rss(self) -> int:
        return self.rss

    async def sleep(self, seconds: float) -> None:
        if self.steps == 0:
            raise asyncio.CancelledError
        self.steps -= 1
        self.now += seconds
        self.rss = self.planned.get(self.now, self.rss)


class FakeTimer(FullCollectionTimer):
    """Records which collections the loop asks for instead of running them."""

    def __init__(self, process: FakeProcess) -> None:
        super().__init__()
        self.process = process

    def collect(self, why: Trigger) -> None:
        self.process.collected.append((self.process.now, why))


async def run_loop(process: FakeProcess) -> None:
    with pytest.raises(asyncio.CancelledError):
        await collect_when_memory_grows(
            lambda trigger, seconds: None,
            growth_bytes=32 * MB,
            ceiling_s=60.0,
            sample_s=1.0,
            read_rss=process.read_rss,
            clock=process.clock,
            sleep=process.sleep,
            timer=FakeTimer(process),
        )


async def test_the_loop_collects_as_the_memory_grows_and_at_the_ceiling() -> None:
    process = FakeProcess(rss=100 * MB, steps=150)
    process.planned = {
        10.0: 120 * MB,  # under the bound
        20.0: 140 * MB,  # 40 MB over the start: collect
        30.0: 171 * MB,  # 31 MB over the level after it: not yet
        31.0: 172 * MB,  # 32 MB: collect
    }
    await run_loop(process)
    assert process.collected == [(20.0, "memory"), (31.0, "memory"), (91.0, "ceiling")]


async def test_the_loop_with_flat_memory_collects_only_at_the_ceiling() -> None:
    process = FakeProcess(rss=100 * MB, steps=130)
    await run_loop(process)
    assert process.collected == [(60.0, "ceiling"), (120.0, "ceiling")]


async def test_every_full_collection_is_timed_with_its_trigger() -> None:
    """The timer sees full collections only, the loop's and the collector's own."""
    seen: list[tuple[Trigger, float]] = []
    with FullCollectionTimer() as timer:
        gc.collect(0)
        timer.collect("memory")
        gc.collect()  # as the collector's threshold would run it
        seen = timer.drain()
    assert [trigger for trigger, _ in seen] == ["memory", "threshold"]
    assert all(seconds >= 0 for _, seconds in seen)
    assert timer._on_gc not in gc.callbacks
