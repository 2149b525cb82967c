"""The full collections the collector tuning still runs: when the memory asks, not by the clock.

``runtime.tune_gc`` makes the collector's own full collections rare (its young generation
counts 50,000 objects, and a few objects can hold megabytes), so something must still
collect cyclic garbage that holds memory. A full collection stops the one event loop for as
long as it scans the objects in flight (120-210 ms with 5,000 records on a busy machine,
docs/performance.md), so running one every 5 s put that stall in the latency tail of
records and retries whether there was garbage or not. The record path leaves none
(``kafka.fetched_records``), so most of those collections found nothing.

Instead, the process's resident memory is read once a second (one small read of
``/proc/self/statm``: about 10 µs) and a full collection runs when it has grown by
``growth_bytes`` since the last one, or when ``ceiling_s`` has passed without one, so that
garbage holding little memory still goes. RSS is what the memory row's target and the
container's limit are about, and it is in bytes, which the collector's own counts (objects
allocated) are not: the garbage that matters is the kind those counts barely see. Its blind
spot: memory a collection frees mostly stays with the allocator, so new garbage refills it
before RSS moves; with garbage that holds memory steadily (aiokafka's fetch cycle restored
on purpose) a 1M drain rose from 130 to 175-192 MB and a 5M drain to 253 MB, still rising
(bench memory row), where a collection every 5 s held it near 128 MB. The record path makes
no such garbage; one that appears is a defect to fix at its cause, as that cycle was.

Every full collection, the collector's own ones included, is timed through
``gc.callbacks`` and reported as ``worker_gc_full_collection_seconds`` by its trigger.
"""

from __future__ import annotations

import asyncio
import gc
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

# Why a full collection ran: grown memory, the ceiling, or the collector's own threshold.
Trigger = Literal["memory", "ceiling", "threshold"]

STATM = Path("/proc/self/statm")
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
# How often the memory is read: a dropped fetch (1 MiB) waits about this long at most
# once the growth bound is reached.
SAMPLE_S = 1.0
# Defaults of the worker's settings (gc_collect_growth_mb, gc_collect_max_interval_s).
GROWTH_MB = 32
MAX_INTERVAL_S = 60.0


def rss_bytes(statm: Path = STATM) -> int | None:
    """The process's resident memory from ``/proc/self/statm``; None where there is none."""
    try:
        fields = statm.read_bytes().split()
        return int(fields[1]) * PAGE_BYTES
    except (OSError, IndexError, ValueError):
        return None


@dataclass
class CollectionTrigger:
    """When the next full collection is due: the memory grew, or it has been too long.

    ``base_rss`` is the resident memory read just after the last collection (or at the
    start): growth is measured from there, so memory that stays at a level, however
    high, asks for nothing, and memory that keeps growing asks once per ``growth_bytes``.
    Where the memory cannot be read (no ``/proc``), only the ceiling applies.
    """

    growth_bytes: int
    ceiling_s: float
    last_at: float
    base_rss: int | None

    def due(self, now: float, rss: int | None) -> Trigger | None:
        if self.base_rss is None:
            self.base_rss = rss
        elif rss is not None and rss - self.base_rss >= self.growth_bytes:
            return "memory"
        if now - self.last_at >= self.ceiling_s:
            return "ceiling"
        return None

    def collected(self, now: float, rss: int | None) -> None:
        self.last_at = now
        self.base_rss = rss


class FullCollectionTimer:
    """Times every full collection (``gc.callbacks``) and notes why it ran.

    The callback only appends to a list: it runs inside whatever allocation set the
    collector off, on any thread, so it takes no lock (a metric's could be held by the
    very thread it interrupts). ``drain`` hands the timings over from the event loop.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._why: Trigger = "threshold"
        self._started: float | None = None
        self._done: list[tuple[Trigger, float]] = []

    def __enter__(self) -> FullCollectionTimer:
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        gc.callbacks.remove(self._on_gc)

    def collect(self, why: Trigger) -> None:
        self._why = why
        try:
            gc.collect()
        finally:
            self._why = "threshold"

    def drain(self) -> list[tuple[Trigger, float]]:
        done, self._done = self._done, []
        return done

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._started = self._clock()
        elif self._started is not None:
            self._done.append((self._why, self._clock() - self._started))
            self._started = None


async def collect_when_memory_grows(
    observe: Callable[[Trigger, float], None],
    *,
    growth_bytes: int = GROWTH_MB * 1024 * 1024,
    ceiling_s: float = MAX_INTERVAL_S,
    sample_s: float = SAMPLE_S,
    read_rss: Callable[[], int | None] = rss_bytes,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    timer: FullCollectionTimer | None = None,
) -> None:
    """Run a full collection whenever the trigger says so, until cancelled.

    ``observe`` receives each full collection's trigger and seconds, the collector's own
    ("threshold") included, once a second. The clock, the memory reading, the sleep and
    the timer are parameters for the unit tests only.
    """
    trigger = CollectionTrigger(growth_bytes, ceiling_s, clock(), read_rss())
    with timer or FullCollectionTimer() as timing:
        while True:
            await sleep(sample_s)
            why = trigger.due(clock(), read_rss())
            if why is not None:
                timing.collect(why)
                trigger.collected(clock(), read_rss())
            for done, seconds in timing.drain():
                observe(done, seconds)
