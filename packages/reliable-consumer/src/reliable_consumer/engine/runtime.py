"""How the worker process runs: which event loop, and the garbage collector's pace.

Both are process-wide choices, made once at start, and both are about CPU per record:
a fast path of a few tens of microseconds per record feels every timer the event loop
schedules and every pass the collector makes over long-lived objects (bench/).

The full collections the collector tuning still runs (``collect_when_memory_grows``): by the
clock, and when the memory asks.

``runtime.tune_gc`` makes the collector's own full collections rare (its young generation
counts 50,000 objects, and a few objects can hold megabytes), so something must still
collect cyclic garbage that holds memory. A full collection stops the one event loop for as
long as it scans the objects in flight (50-225 ms with 5,000 records in flight on a busy
machine, docs/performance.md).

The process's resident memory is read once a second (one small read of
``/proc/self/statm``: about 10 µs) and a full collection runs when it has grown by
``growth_bytes`` since the last one, or when ``ceiling_s`` has passed without one. RSS is
what the memory row's target and the container's limit are about, and it is in bytes, which
the collector's own counts (objects allocated) are not: the garbage that matters is the kind
those counts barely see. The ceiling defaults to 5 s, the interval the worker always had:
a 60 s ceiling took the drain of 1M records from 15 full collections to 1-2 with the same
flat memory, but its p99s could not be told apart from 5 s on this machine, and against
garbage that holds memory steadily (aiokafka's fetch cycle restored on purpose) RSS alone
was a weak trigger: memory a collection frees mostly stays with the allocator, so new
garbage refills it before RSS moves (a 5M drain rose to 253 MB and kept rising, where 5 s
held it near 128 MB). An operator who sees the stall in the tail and flat memory may raise
``WORKER_GC_COLLECT_MAX_INTERVAL_S``.

Every full collection, the collector's own ones included, is timed through
``gc.callbacks`` and reported as ``worker_gc_full_collection_seconds`` by its trigger.
"""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import os
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, TypeVar

T = TypeVar("T")
LoopChoice = Literal["auto", "asyncio", "uvloop"]

# Young objects allocated between collections (CPython's default is 700).
GC_YOUNG_THRESHOLD = 50_000


def loop_factory(choice: LoopChoice) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop to run on: uvloop when chosen, or on ``auto`` when it is installed.

    uvloop keeps timers and callbacks in C; with 10 ms async handlers that was worth
    about 5% more records per second here. None means asyncio's own loop.
    """
    if choice == "asyncio":
        return None
    if choice == "auto" and importlib.util.find_spec("uvloop") is None:
        return None
    import uvloop  # a missing module on "uvloop" fails at start, naming it

    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T], choice: LoopChoice = "auto") -> T:
    """``asyncio.run`` on the chosen event loop."""
    with asyncio.Runner(loop_factory=loop_factory(choice)) as runner:
        return runner.run(main)


def tune_gc() -> None:
    """Keep the cyclic garbage collector off the hot path.

    Every record allocates a few dozen short-lived objects, so with CPython's defaults
    the collector ran thousands of times per 100k records and its full collections
    re-scanned every long-lived object (modules, clients, metrics): a third of the
    worker's CPU in bench/. Freezing what exists once started moves those objects out of
    the collector's sight, and a larger young generation makes collections rare.

    Half of the tuning: the threshold counts objects, not bytes, so garbage of a few
    objects holding much memory would pile up under it. The other half runs beside it
    (the worker starts both): ``collect_when_memory_grows`` runs a full
    collection at least every 5 s, and sooner when the process's memory has grown since
    the last one, each timed by its trigger. A longer interval (``WORKER_GC_COLLECT_MAX_
    INTERVAL_S``) takes most of those stalls of the event loop away (each scans the
    records in flight: 50-225 ms with 5,000 of them) but was measured weaker against
    garbage that holds memory, and no latency figure could tell it apart (docs/performance.md,
    row 4), so the default stays 5 s.
    """
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)


# Why a full collection ran: grown memory, the ceiling, or the collector's own threshold.
Trigger = Literal["memory", "ceiling", "threshold"]

STATM = Path("/proc/self/statm")
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
# How often the memory is read: a dropped fetch (1 MiB) waits about this long at most
# once the growth bound is reached.
SAMPLE_S = 1.0
# Defaults of the worker's settings (gc_collect_growth_mb, gc_collect_max_interval_s).
GROWTH_MB = 32
MAX_INTERVAL_S = 5.0


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
